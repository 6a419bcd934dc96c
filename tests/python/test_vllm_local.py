"""The vLLM backend's trainer side sending each trainer rank's own piece (``WeightSource.iter_local()``),
never a gathered tensor: two trainer ranks (torch.distributed gloo; this process is rank 0, a spawned
process rank 1) publish one version together through ParamCast's many senders
(``ParamCastTrainerInitInfo.ranks = 2``) to two imitated tensor-parallel vLLM workers (vllm_contract.py).

- A transformers Llama sharded with FSDP2 (``fully_shard``, CPU) behind vLLM 0.33.0's own
  ``ModuleSource`` (the pinned wheel, vllm_real.py; skipped, saying why, without it): its
  ``iter_local()`` yields each DTensor's ``to_local()``.
- A hand-written Megatron-style source (``SplitSource``, no vLLM needed): row-parallel weights split
  along dim 1, the others along dim 0, some with the owners in reverse order, some on a 2-d mesh with a
  Replicate axis, norms on every rank whole, one tensor a declared replica.

Checked: the workers hold the unsharded model bit for bit after a round and after an optimizer step; no
trainer rank gathered anything during ``send_weights`` (``DTensor.full_tensor`` calls and the source's
own all-gathers counted on each rank: 0), and what each rank handed ParamCast is exactly its piece; a
rank whose piece has the wrong shape, or ranks declaring different placements, are refused on every rank
before any byte moves, naming the tensor, the rank and both shapes (layouts), and the next round is
whole again. A source without ``iter_local`` (or ``iterate="full"``) still sends through ``iter_full``."""

import collections
import contextlib
import dataclasses
import importlib
import os
import re
import socket
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # (test_vllm_fp8_ranks.py imports this module's harness, which needs neither)
    fully_shard = DTensor = None
needs_fsdp2 = pytest.mark.skipif(fully_shard is None, reason="needs PyTorch >= 2.6 (FSDP2's fully_shard, DTensor); "
                                 f"here {torch.__version__}")

# vLLM's own WeightSource/ModuleSource from the pinned wheel, where it can be had (as test_vllm_real.py).
SRC, NO_VLLM = None, None
if sys.version_info < (3, 11):
    NO_VLLM = "vLLM 0.33.0's base.py needs Python >= 3.11 (typing.Self)"
else:
    import fetch_vllm
    import vllm_real
    try:
        SRC = fetch_vllm.fetch(fetch_vllm.cache_root([]))
    except RuntimeError as e:
        NO_VLLM = f"vLLM {fetch_vllm.VERSION}'s wheel could not be fetched: {e}"
    _spec = importlib.util.find_spec("vllm")
    if SRC is not None and _spec is not None and _spec.origin is not None and not _spec.origin.startswith(SRC):
        SRC, NO_VLLM = None, f"an installed vLLM ({_spec.origin}) would shadow the pinned {fetch_vllm.VERSION}"
# vLLM goes on the trainers' path only when a test uses its ModuleSource (Side.use), after the worker
# processes started: a worker seeing it would take vLLM's engine base, which needs an accelerator.

from paramcast.integrations import vllm as backend  # noqa: E402

from cluster import config_dict  # noqa: E402
from vllm_contract import Client  # noqa: E402
from vllm_fixtures import LLAMA, hf_state, make_model, train_step  # noqa: E402

TP = 2


# ---- vLLM 0.33.0's ParamMeta and placements, as data (weight_transfer/base.py), for sources without vLLM ----
@dataclasses.dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: object
    shape: tuple
    owners: tuple = None
    mesh_shape: tuple = None
    placements: tuple = None


@dataclasses.dataclass(frozen=True)
class Shard:
    dim: int


@dataclasses.dataclass(frozen=True)
class Replicate:
    pass


# What each rank gathered during a round: DTensor.full_tensor calls and a source's own all-gathers.
GATHERS = collections.Counter()


def count_gathers():
    """Counts every DTensor.full_tensor call in this process (an FSDP all-gather); idempotent."""
    if DTensor is None or getattr(DTensor.full_tensor, "_counted", False):
        return
    original = DTensor.full_tensor

    def full_tensor(self, *args, **kwargs):
        GATHERS["full_tensor"] += 1
        return original(self, *args, **kwargs)

    full_tensor._counted, full_tensor._original = True, original
    DTensor.full_tensor = full_tensor


def cut(full, owners, mesh_shape, placements, rank):
    """Rank ``rank``'s piece of ``full``, cut with torch.chunk axis by axis (the test's own statement of
    the layout, independent of paramcast.reshard)."""
    index, coordinate = owners.index(rank), []
    for extent in reversed(mesh_shape):
        coordinate.insert(0, index % extent)
        index //= extent
    piece = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = torch.chunk(piece, mesh_shape[axis], p.dim)
            piece = chunks[coordinate[axis]] if coordinate[axis] < len(chunks) else piece.narrow(p.dim, 0, 0)
    return piece


def megatron_layout(name, shape, rank):
    """(owners, mesh_shape, placements) of a Megatron-style split over trainer ranks 0 and 1, or None (every
    rank holds it whole): row-parallel o_proj/down_proj along dim 1; q/k/v/gate/up along dim 0 (layer 1's
    with the owners in reverse order: rank 1 holds the first half); the embedding on a 2x1 mesh and
    lm_head on a 1x2 mesh (a Replicate axis each); the final norm a declared replica; other norms None."""
    if len(shape) == 1:
        return ((0, 1), (2,), None) if name == "model.norm.weight" else None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (0, 1), (2,), (Shard(1),)
    if name == "model.embed_tokens.weight":
        return (0, 1), (2, 1), (Shard(0), Replicate())
    if name == "lm_head.weight":
        return (0, 1), (1, 2), (Replicate(), Shard(0))
    return ((1, 0) if ".layers.1." in name else (0, 1)), (2,), (Shard(0),)


def rank1_splits_q_by_columns(name, shape, rank):
    """megatron_layout, except that rank 1 declares layer 0's q_proj split along dim 1 (metadata that differs
    between the ranks)."""
    if rank == 1 and name == "model.layers.0.self_attn.q_proj.weight":
        return (0, 1), (2,), (Shard(1),)
    return megatron_layout(name, shape, rank)


class SplitSource:
    """A vLLM WeightSource (metadata, iter_local, iter_full) of a tensor-parallel trainer over ranks 0 and 1,
    written by hand: ``layout(name, shape, rank)`` lays each tensor out; each rank keeps only its pieces.
    ``iter_local()`` yields them; ``iter_full()`` all-gathers each (counted in GATHERS), as such a
    trainer would to hand out whole tensors. ``wrong``: (name, rank) whose piece is one column short;
    ``rename``: {name: the name it is declared and sent under}."""

    def __init__(self, model, rank, layout, wrong=None, rename=None):
        self.rank, self.metadata, self.pieces = rank, [], {}
        for name, p in model.named_parameters():
            name = (rename or {}).get(name, name)
            shape, lay = tuple(p.shape), layout(name, tuple(p.shape), rank)
            if lay is None:
                self.metadata.append(ParamMeta(name, p.dtype, shape))
                self.pieces[name] = p.detach().clone()
                continue
            owners, mesh_shape, placements = lay
            self.metadata.append(ParamMeta(name, p.dtype, shape, owners=owners, mesh_shape=mesh_shape,
                                           placements=placements))
            whole = placements is None
            self.pieces[name] = (p.detach() if whole else cut(p.detach(), owners, mesh_shape, placements, rank)).clone()
            if wrong == (name, rank):
                self.pieces[name] = self.pieces[name][:, :-1]
        self.yielded = {}

    def iter_local(self):
        self.yielded = {}  # what this rank handed out this round: {name: shape}
        for m in self.metadata:
            self.yielded[m.name] = tuple(self.pieces[m.name].shape)
            yield m.name, self.pieces[m.name]

    def iter_full(self):
        import torch.distributed as dist
        self.yielded = {}
        for m in self.metadata:
            piece = self.pieces[m.name]
            if m.placements is not None:  # one Shard axis of extent 2 in these layouts
                GATHERS["all_gather"] += 1
                parts = [None, None]
                dist.all_gather_object(parts, piece)  # (pieces of any shape: a wrong one shows in the result)
                dim = next(p.dim for p in m.placements if isinstance(p, Shard))
                piece = torch.cat([parts[r] for r in m.owners], dim)
            self.yielded[m.name] = tuple(piece.shape)
            yield m.name, piece


class FullOnly(SplitSource):
    """The same trainer with a source that has no iter_local (a vLLM source implementing iter_full only)."""

    iter_local = None

    def implements_iter_local(self):
        return False


class Side:
    """One trainer rank: its engine (trainer_init), its model and source; each method is called on both ranks
    in step (rank 1's from the test's commands)."""

    def __init__(self, rank, client, llama=LLAMA, dtype=None, layout=None, **init):
        torch.set_num_threads(1)
        count_gathers()
        self.rank, self.model, self.reference = rank, None, None
        self.llama, self.dtype, self.layout = llama, dtype, layout or megatron_layout
        cfg = config_dict(subscribers=TP)
        info = backend.ParamCastTrainerInitInfo(config=cfg, ranks=2, rank=rank,
                                                engine_config={k: v for k, v in cfg.items() if k != "publisher"},
                                                **init)
        self.engine = backend.ParamCastTrainerWeightTransferEngine.trainer_init(info, client=client, source=None)

    def use(self, kind):
        """kind "fsdp": FSDP2 over both ranks behind vLLM's ModuleSource; "split": SplitSource (Megatron)."""
        self.kind = kind
        self.model = make_model(self.llama, self.dtype)
        # The unsharded model, trained alike.
        self.reference = self.model if kind == "split" else make_model(self.llama, self.dtype)
        if kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2,))
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.source()

    def source(self, wrong=None, full_only=False, layout=None, rename=None):
        if self.kind == "fsdp":
            vllm_real.use(SRC)
            from vllm.distributed.weight_transfer.base import ModuleSource

            class Recording(ModuleSource):  # vLLM's ModuleSource, noting the shape of each piece it yields
                def iter_local(self):
                    self.yielded = {}
                    for name, piece in super().iter_local():
                        self.yielded[name] = tuple(piece.shape)
                        yield name, piece

            self.engine.source = Recording(self.model)
        else:
            self.engine.source = (FullOnly if full_only else SplitSource)(self.model, self.rank,
                                                                          layout or self.layout, wrong, rename)

    def set_iterate(self, mode, rank=None):
        if rank is None or rank == self.rank:
            self.engine.iterate = mode

    def gathers(self):
        return dict(GATHERS)

    def break_metadata(self, rank):
        """On ``rank`` only, a source whose metadata raises (restored by ``source()``)."""
        if rank != self.rank:
            return

        class NoMetadata:
            def __init__(self, inner):
                self._inner = inner

            @property
            def metadata(self):
                raise RuntimeError("metadata unavailable on this rank")

            def __getattr__(self, name):
                return getattr(self._inner, name)

        self.engine.source = NoMetadata(self.engine.source)

    def step(self):
        train_step(self.model)
        if self.reference is not self.model:
            train_step(self.reference)
        self.source()

    def send(self):
        GATHERS.clear()
        self.result = self.engine.send_weights()
        said = {"version": self.result.version, "gathers": dict(GATHERS), "transformed": self.result.transformed,
                "tensors": self.result.tensors}
        if self.kind == "fsdp":  # what this rank holds: its DTensors' local shards
            said["own"] = {n: tuple(p.to_local().shape) for n, p in self.model.named_parameters()}
        else:
            said["own"] = {n: tuple(t.shape) for n, t in self.engine.source.pieces.items()}
        said["yielded"] = getattr(self.engine.source, "yielded", None)  # what it handed ParamCast
        said["layouts"] = {m.name: (m.owners, m.mesh_shape, m.placements) for m in self.engine.source.metadata}
        return said

    def close(self):
        self.engine.shutdown()


def peer_main(port, commands, answers, options):
    """Trainer rank 1: runs Side's methods as the test names them, answering each."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=1, world_size=2)
    side = None
    try:
        side = Side(1, None, **options)
        while True:
            name, args = commands.get(timeout=180)
            if name == "exit":
                return
            try:
                answers.put(("ok", getattr(side, name)(*args)))
            except Exception as e:  # noqa: BLE001 - the test reads it
                answers.put(("error", type(e).__name__, str(e)))
    finally:
        if side is not None:
            side.close()
        dist.destroy_process_group()


class Trainers:
    """Both trainer ranks: ``both(name, *args)`` runs Side.<name> here (rank 0) and on rank 1 together."""

    def both(self, name, *args):
        self.commands.put((name, args))
        try:
            mine = ("ok", getattr(self.side, name)(*args))
        except Exception as e:  # noqa: BLE001 - the test reads it
            mine = ("error", type(e).__name__, str(e))
        return mine, self.answers.get(timeout=180)

    def ok(self, name, *args):
        mine, theirs = self.both(name, *args)
        assert mine[0] == "ok" and theirs[0] == "ok", f"{name}: rank 0 {mine}, rank 1 {theirs}"
        return mine[1], theirs[1]


@contextlib.contextmanager
def start_trainers(make_client, **options):
    """Trainer ranks 0 (here) and 1 (a spawned process) over gloo, each a Side(rank, ..., **options) whose
    engine publishes to the workers of ``make_client()`` (made while rank 1 starts; closed at the end)."""
    import spawning

    import torch.distributed as dist
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = spawning.context(spawning.LLAMA)
    commands, answers = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=peer_main, args=(port, commands, answers, options), daemon=True,
                       name="trainer-rank-1")
    peer.start()
    side = client = None
    try:
        client = make_client()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=2)
        side = Side(0, client, **options)
        t = Trainers()
        t.client, t.side, t.commands, t.answers = client, side, commands, answers
        yield t
    finally:
        commands.put(("exit", ()))
        peer.join(60)
        if peer.is_alive():
            peer.kill()
        if side is not None:
            side.close()
        if client is not None:
            client.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if DTensor is not None and getattr(DTensor.full_tensor, "_counted", False):
            DTensor.full_tensor = DTensor.full_tensor._original


@pytest.fixture(scope="module")
def trainers():
    with start_trainers(lambda: Client(TP, LLAMA)) as t:
        yield t


def assert_workers_hold(client, state):
    for rank, report in enumerate(client.rpc("check", hf_state=state)):
        assert report["bad"] == [], f"worker {rank}: parameters differ from the unsharded model's: {report['bad']}"
        assert report["untouched"] == [], f"worker {rank}: never loaded: {report['untouched']}"


def assert_no_gather(said, rank):
    assert said["gathers"] == {}, f"trainer rank {rank} gathered during send_weights: {said['gathers']}"


def model_bytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


@needs_fsdp2
@pytest.mark.skipif(SRC is None, reason=f"vLLM's ModuleSource comes from the pinned wheel: {NO_VLLM}")
def test_fsdp2_ranks_send_their_local_shards_through_vllms_module_source(trainers):
    trainers.ok("use", "fsdp")
    metas = trainers.side.engine.source.metadata
    assert all(m.owners == (0, 1) and type(m.placements[0]).__name__ == "Shard" and m.placements[0].dim == 0
               for m in metas), "FSDP2 shards every parameter along dim 0 over both ranks"
    assert trainers.side.engine.source.implements_iter_local()
    versions = []
    for what in ("round", "step"):
        if what == "step":
            trainers.ok("step")
        mine, theirs = trainers.ok("send")
        result = trainers.side.result
        want = hf_state(trainers.side.reference)
        assert result.ok and theirs["version"] == result.version, (result, theirs)
        for rank, said in enumerate((mine, theirs)):
            assert_no_gather(said, rank)
            # What this rank handed ParamCast is exactly its FSDP2 shard of each parameter (half its rows).
            assert said["yielded"] == said["own"], (rank, said["yielded"] and {
                n: (said["yielded"].get(n), s) for n, s in said["own"].items() if said["yielded"].get(n) != s})
        for name, full in want.items():
            a, b = mine["own"][name], theirs["own"][name]
            assert a[0] + b[0] == full.shape[0] and a[0] < full.shape[0] and a[1:] == b[1:] == full.shape[1:], \
                (name, a, b, tuple(full.shape))
        assert result.bytes == model_bytes(want) and result.wire_bytes == TP * model_bytes(want), result
        assert_workers_hold(trainers.client, want)
        versions.append(result.version)
    assert versions[1] == versions[0] + 1


def test_megatron_style_pieces_are_sent_where_their_placements_put_them(trainers):
    trainers.ok("use", "split")
    versions = []
    for what in ("round", "step"):
        if what == "step":
            trainers.ok("step")
        mine, theirs = trainers.ok("send")
        result = trainers.side.result
        want = hf_state(trainers.side.reference)
        assert result.ok and theirs["version"] == result.version, (result, theirs)
        for rank, said in enumerate((mine, theirs)):
            assert_no_gather(said, rank)
            # What this rank handed ParamCast is exactly the piece it holds (for a split tensor, half of it).
            assert said["yielded"] == said["own"], (rank, {n: (said["yielded"].get(n), s) for n, s in
                                                           said["own"].items() if said["yielded"].get(n) != s})
        split = [n for n, (owners, _, placements) in mine["layouts"].items() if placements is not None]
        assert len(split) == 2 * 7 + 2
        for name in split:
            full = tuple(want[name].shape)
            a, b = mine["own"][name], theirs["own"][name]
            assert a != full and b != full and torch.Size(a).numel() + torch.Size(b).numel() == want[name].numel(), \
                (name, a, b, full)
        assert result.bytes == model_bytes(want), result
        assert_workers_hold(trainers.client, want)
        versions.append(result.version)
    assert versions[1] == versions[0] + 1

    # Rank 1's piece of one row-parallel weight is a column short: refused on both ranks before any byte moves.
    name = "model.layers.0.self_attn.o_proj.weight"
    mine, theirs = trainers.both("source", (name, 1))
    assert mine[0] == theirs[0] == "ok"
    mine, theirs = trainers.both("send")
    assert mine[0] == "error" and theirs[0] == "error", (mine, theirs)
    expected = re.escape(f"trainer rank 1 yields a piece of '{name}' shaped (64, 31), but its layout (owners (0, 1), "
                         f"mesh (2,), placements [Shard(1)]) gives rank 1 (64, 32) at offsets (0, 32) of "
                         f"torch.float32 (64, 64)")
    for said in (mine[2], theirs[2]):
        assert said.startswith("paramcast send_weights refused before any byte moved: ") and \
            re.search(expected, said), said
    assert trainers.side.engine.publisher.status()["version"] == versions[-1], "a refused round published a version"
    assert_workers_hold(trainers.client, want)  # the last round's bytes, untouched

    # Rank 1 declares (and holds) layer 0's q_proj split by columns, rank 0 by rows: refused, naming both.
    trainers.ok("source", None, False, rank1_splits_q_by_columns)
    mine, theirs = trainers.both("send")
    expected = re.escape("trainer ranks 0 and 1 declare 'model.layers.0.self_attn.q_proj.weight' differently: "
                         "rank 0 declares torch.float32 (64, 64) owned by (0, 1) on mesh (2,) as [Shard(0)], "
                         "rank 1 declares torch.float32 (64, 64) owned by (0, 1) on mesh (2,) as [Shard(1)]")
    for said in (mine, theirs):
        assert said[0] == "error" and re.search("refused before any byte moved: .*" + expected, said[2]), said
    assert trainers.side.engine.publisher.status()["version"] == versions[-1], "a refused round published a version"

    trainers.ok("source")  # the next round is whole again
    mine, theirs = trainers.ok("send")
    assert trainers.side.result.version == versions[-1] + 1 and theirs["version"] == versions[-1] + 1
    assert_workers_hold(trainers.client, want)
    versions.append(trainers.side.result.version)

    # A round that fails once its version is taken (the workers' load_weights does not know a name): that
    # version is never used again, and the next round takes the one after it.
    trainers.ok("source", None, False, None, {"lm_head.weight": "output.weight"})
    mine, theirs = trainers.both("send")
    assert mine[0] == "error" and "load_weights failed: KeyError: 'output.weight'" in mine[2], mine
    trainers.ok("source")
    mine, theirs = trainers.both("send")
    assert mine[0] == "ok" and theirs[0] == "ok", f"the round after a failed one: rank 0 {mine}, rank 1 {theirs}"
    assert trainers.side.result.version == versions[-1] + 2 and theirs[1]["version"] == versions[-1] + 2
    assert_workers_hold(trainers.client, want)


def test_a_source_without_iter_local_is_iterated_whole_and_iterate_full_forces_it(trainers):
    """iter_full stays the path for a source without iter_local, and for init_info.iterate = "full": each rank
    hands ParamCast whole tensors (the source gathers them) and the workers still hold the model."""
    trainers.ok("use", "split")
    want = hf_state(trainers.side.reference)
    gathered = {"all_gather": 2 * 7 + 2}
    try:
        for mode, full_only in (("full", False), ("auto", True)):
            trainers.ok("set_iterate", mode)
            trainers.ok("source", None, full_only)
            for rank, said in enumerate(trainers.ok("send")):
                assert said["gathers"] == gathered, (mode, rank, said["gathers"])
                assert said["yielded"] == {n: tuple(t.shape) for n, t in want.items()}, (mode, rank)
            assert trainers.side.result.bytes == model_bytes(want)
            assert_workers_hold(trainers.client, want)
        version = trainers.side.engine.publisher.status()["version"]
        trainers.ok("set_iterate", "local")
        mine, theirs = trainers.both("send")
        for said in (mine, theirs):
            assert said[0] == "error" and re.search(
                r"refused before any byte moved: .*trainer rank 0: init_info.iterate is 'local' but its source "
                r"\(FullOnly\) does not implement iter_local; trainer rank 1: init_info.iterate is 'local'",
                said[2]), said
        assert trainers.side.engine.publisher.status()["version"] == version
    finally:
        trainers.ok("set_iterate", "auto")


def test_ranks_that_would_iterate_differently_are_refused_before_either_iterates(trainers):
    """Rank 1 told iterate="full" (its source's iter_full gathers, a collective rank 0 would never join),
    rank 0 its pieces: both are refused, naming both ways, before either rank iterates (no gather began),
    and the next round, alike again, goes through."""
    trainers.ok("use", "split")
    want = hf_state(trainers.side.reference)
    version = trainers.side.engine.publisher.status()["version"]
    try:
        trainers.ok("set_iterate", "full", 1)
        mine, theirs = trainers.both("send")
        for said in (mine, theirs):
            assert said[0] == "error" and re.search(
                r"refused before any byte moved: trainer ranks 0 and 1 would iterate their sources differently "
                r"\(rank 0 iter_local, rank 1 iter_full\)", said[2]), said
        for rank, gathered in enumerate(trainers.ok("gathers")):
            assert gathered == {}, f"trainer rank {rank} began to gather: {gathered}"
        assert trainers.side.engine.publisher.status()["version"] == version
    finally:
        trainers.ok("set_iterate", "auto")
    for rank, said in enumerate(trainers.ok("send")):
        assert said["gathers"] == {}, (rank, said["gathers"])
    assert_workers_hold(trainers.client, want)


def test_a_rank_whose_source_raises_before_iterating_is_refused_on_every_rank(trainers):
    """Rank 1's source raises when asked for its metadata: both ranks are refused, naming rank 1 and the
    error, instead of rank 0 waiting in the agreement for a rank that left."""
    trainers.ok("use", "split")
    version = trainers.side.engine.publisher.status()["version"]
    try:
        trainers.ok("break_metadata", 1)
        mine, theirs = trainers.both("send")
        for said in (mine, theirs):
            assert said[0] == "error" and ("trainer rank 1: reading its source's metadata raised RuntimeError: "
                                           "metadata unavailable on this rank") in said[2], said
        assert trainers.side.engine.publisher.status()["version"] == version
    finally:
        trainers.ok("source")


def test_init_info_iterate_and_transforms_with_several_ranks_are_checked():
    with pytest.raises(ValueError, match=r"init_info.iterate: expected 'auto', 'local' or 'full', got 'pieces'"):
        backend.ParamCastTrainerInitInfo(config={}, ranks=2, rank=0, iterate="pieces")
    rules = [{"match": "*proj.weight", "fp8": "block"}]
    with pytest.raises(ValueError, match=r"init_info.transforms: with several trainer ranks .* a YAML config keeps "
                                         r"its own: pass the config as a dict"):
        backend.ParamCastTrainerInitInfo(config="trainer.yaml", ranks=2, rank=1, transforms=rules)
    backend.ParamCastTrainerInitInfo(config={}, ranks=2, rank=1, transforms=rules)  # a dict config takes them
