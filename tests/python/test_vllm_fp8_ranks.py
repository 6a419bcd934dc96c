"""FP8 through the vLLM backend with several trainer ranks: each rank quantizes only its own pieces.

Two trainer ranks (torch.distributed gloo; this process rank 0, a spawned one rank 1; the harness of
test_vllm_local.py) hold a BF16 transformers Llama (hidden 256, intermediate 512, two 128-wide heads, one
KV head) split Megatron-style: q_proj, gate_proj and up_proj by rows, o_proj and down_proj by columns,
each rank's half a whole number of 128x128 blocks; the one KV head's k_proj/v_proj (128 rows) on both
ranks whole. They publish with ``ParamCastTrainerInitInfo(ranks=2, transforms=[..., "*proj.weight":
fp8 block])`` to two TP=2 workers holding test_vllm_fp8.py's block-FP8 vLLM model (``slices: "off"``).
Checked: the workers were told the rules at init and every round's names list each scale; each worker's
``load_weights`` was given every ``<name>`` as float8_e4m3fn and ``<name>_scale_inv`` bit for bit
fp8_reference.py's quantization of the whole BF16 tensor (norms and embeddings the trainer's); no rank
gathered; both ranks quantized (each its own pieces). A split whose cut falls inside a block (k_proj's
128 rows cut at 64) is refused on both ranks before any byte moves, naming the tensor and the box, the
workers keeping the last round's bytes; the next round is whole again."""

import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip(f"needs PyTorch with torch.float8_e4m3fn (>= 2.1); here {torch.__version__}", allow_module_level=True)

import test_vllm_fp8 as fp8  # noqa: E402  (its worker process, FP8 checkpoint and per-worker checks)
from test_vllm_local import Shard, TP, start_trainers  # noqa: E402
import vllm_fp8_model  # noqa: E402
from vllm_contract import Client  # noqa: E402

LLAMA = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128, tie_word_embeddings=False, max_position_embeddings=64)
RULES = fp8.RULES  # [{"match": "*norm*", "keep": True}, {"match": "*proj.weight", "fp8": "block"}]


def aligned_layout(name, shape, rank):
    """Each rank's half of every FP8 weight a whole number of 128x128 blocks; k/v (one KV head, 128 rows)
    whole on both ranks, as a tensor-parallel trainer replicates a KV head it has fewer of than ranks;
    embeddings and lm_head by rows (no rule: any cut); norms whole."""
    if len(shape) == 1 or name.endswith(("k_proj.weight", "v_proj.weight")):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (0, 1), (2,), (Shard(1),)
    return (0, 1), (2,), (Shard(0),)


def misaligned_layout(name, shape, rank):
    """The same, with k_proj split by rows too: 64 rows each, a cut inside its one 128-row block."""
    if name.endswith("k_proj.weight"):
        return (0, 1), (2,), (Shard(0),)
    return aligned_layout(name, shape, rank)


class RecordingClient(Client):
    """The workers' client, keeping what the trainer told them (init_info, each update_info)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.told = []

    def init_weight_transfer_engine(self, init_info):
        self.told.append(("init", init_info))
        super().init_weight_transfer_engine(init_info)

    def update_weights(self, update_info):
        self.told.append(("update", update_info))
        super().update_weights(update_info)


def test_two_ranks_send_block_fp8_of_their_own_pieces_and_a_cut_inside_a_block_is_refused():
    with start_trainers(lambda: RecordingClient(TP, LLAMA, target=fp8.worker_main), llama=LLAMA,
                        dtype=torch.bfloat16, layout=aligned_layout, transforms=RULES,
                        engine_init={"slices": "off"}) as trainers:
        client = trainers.client
        assert client.told[0][0] == "init" and client.told[0][1]["transforms"] == RULES, client.told[0]
        trainers.ok("use", "split")
        model = trainers.side.model  # rank 0's copy of the whole BF16 model (it keeps only its pieces)
        ckpt = fp8.checkpoint(model, RULES)
        scales = [n for n in ckpt if n.endswith("_scale_inv")]
        assert len(scales) == 7

        mine, theirs = trainers.ok("send")
        result = trainers.side.result
        assert result.ok and theirs["version"] == result.version, (result, theirs)
        assert client.told[-1][0] == "update" and sorted(client.told[-1][1]["names"]) == sorted(ckpt), \
            "update_info.names must list every tensor and each FP8 tensor's scales"
        for rank, said in enumerate((mine, theirs)):
            assert said["gathers"] == {}, (rank, said["gathers"])
            assert said["yielded"] == said["own"], rank
            # 5 split FP8 weights, each this rank's half, + k_proj and v_proj, which both hold whole.
            assert said["transformed"] == 7, (rank, said["transformed"])
        fp8.assert_round(client, ckpt)  # every worker: names, dtypes, shapes and bytes of fp8_reference's
        version = result.version

        # k_proj cut at row 64 on both ranks: ParamCast refuses each rank's box before any byte moves.
        trainers.ok("source", None, False, misaligned_layout)
        mine, theirs = trainers.both("send")
        assert mine[0] == "error" and theirs[0] == "error", (mine, theirs)
        name = re.escape("model.layers.0.self_attn.k_proj.weight")
        for rank, said in enumerate((mine, theirs)):
            box = r"rows \[0, 64\) cols \[0, 256\)" if rank == 0 else r"rows \[64, 128\) cols \[0, 256\)"
            assert re.search(name + r"' " + box + r" of \[128, 256\]: fp8: block needs a shard's edges on "
                             r"multiples of 128", said[2]), (rank, said)
        assert "publisher abandoned update" in mine[2] and "before any byte reached this engine" in mine[2], mine
        assert trainers.side.engine.publisher.status()["version"] == version, "a refused round published"
        for rank, report in enumerate(client.rpc("check", ckpt=vllm_fp8_model.pack(ckpt))):
            assert report["given"] == [], f"worker {rank}: the refused round reached load_weights"
            assert report["bad"] == [], f"worker {rank}: parameters changed by a refused round: {report['bad']}"

        trainers.ok("source")  # the aligned split again: the next round is whole
        mine, theirs = trainers.ok("send")
        assert trainers.side.result.version == version + 1 == theirs["version"]
        fp8.assert_round(client, ckpt)
