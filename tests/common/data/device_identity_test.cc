// Device identity: GPUs named by ordinal or by UUID, in a device string and
// in the YAML, and resolution to the ordinal this process sees.
#include <gtest/gtest.h>

#include "common/config.h"
#include "common/data/device_memory.h"
#include "tests/support/process.h"

namespace paramcast {
namespace {

constexpr const char* kUuid = "GPU-8a7f3c2e-1b4d-4e5f-9a6b-7c8d9e0f1a2b";

TEST(DeviceIdentityTest, ParsesOrdinalsAndUuids) {
  EXPECT_EQ(parse_device("cuda:3").value(), Device::cuda(3));
  auto d = parse_device(std::string("cuda:") + kUuid);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE(d->is_cuda());
  EXPECT_EQ(d->uuid, kUuid);
  EXPECT_EQ(d->to_string(), std::string("cuda:") + kUuid);
  EXPECT_TRUE(parse_device("cuda:MIG-5c3a1d2e-0f9b-4a7c-8e6d-1b2c3d4e5f60").ok());
  for (const char* bad : {"cuda:GPU-", "cuda:GPU-xyz!", "cuda:gpu0", "cuda:FOO-1234", "cuda:-1"}) {
    auto e = parse_device(bad);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.status().message().find("cuda:GPU-<uuid>"), std::string::npos) << e.status().message();
  }
}

TEST(DeviceIdentityTest, YamlNamesDevicesByUuidOrOrdinal) {
  auto c = load_config_string(std::string("data_plane: {backend: nccl}\n"
                                          "publisher: {device: cuda:0, subscribers: 2}\n"
                                          "subscriber: {devices: [cuda:1, cuda:") +
                              kUuid + "]}\n");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->subscriber.devices[0], Device::cuda(1));
  EXPECT_EQ(c->subscriber.devices[1].uuid, kUuid);
  auto bad = load_config_string("data_plane: {backend: nccl}\npublisher: {device: 'cuda:GPU-?'}\n", "x.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("publisher.device"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("cuda:GPU-?"), std::string::npos) << bad.status().message();
}

TEST(DeviceIdentityTest, ResolutionNamesTheUuidAndWhatIsVisible) {
  EXPECT_EQ(resolve_device(Device::cuda(2)).value(), Device::cuda(2));  // ordinals stay
  EXPECT_EQ(resolve_device(Device::cpu()).value(), Device::cpu());
  Device d = parse_device(std::string("cuda:") + kUuid).value();
  auto r = resolve_device(d);  // no GPU has this made-up UUID
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(kUuid), std::string::npos) << r.status().message();
  EXPECT_EQ(resolve_device_or_keep(d), d);
  auto mem = create_device_memory(d);
  ASSERT_FALSE(mem.ok());
  EXPECT_NE(mem.status().message().find(kUuid), std::string::npos) << mem.status().message();
}

}  // namespace
}  // namespace paramcast
