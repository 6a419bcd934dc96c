"""The trainer's side of ParamCast's vLLM backend: the ParamCast publisher the vLLM workers receive from.

Part of ``paramcast.integrations.vllm`` (which re-exports every name here; import them from there).

Trainer side: ``ParamCastTrainerWeightTransferEngine.trainer_init(init_info,
client=..., source=...)`` then ``send_weights()`` per round (vLLM >= 0.28),
or ``ParamCastWeightTransferEngine.trainer_send_weights(iterator, args)``
(the static form of vLLM 0.20-0.27, on the worker's engine class in
``vllm.py``; its arguments, ``ParamCastTrainerSendWeightsArgs``, are here).

Several trainer ranks (``ParamCastTrainerInitInfo.ranks`` = M > 1; pipeline stages, FSDP or DTensor
owners): every rank 0..M-1 calls ``trainer_init`` and ``send_weights``, and each sends only the
parameters vLLM's ``ParamMeta.owners`` gives it (None: every rank), through ParamCast's many senders
(rank 0 ``Publisher.weight_update_sharded``, the others a ``PublisherRank``). A source with
``iter_local()`` (vLLM's ModuleSource: each DTensor's ``to_local()``, no all-gather) is iterated that
way: each rank sends only its piece, as the box ``paramcast.reshard.piece_of`` computes from the
parameter's ``owners``, ``mesh_shape`` and ``placements`` (no placements: every owner holds it whole).
Without ``iter_local`` (or with ``init_info.iterate = "full"``) each rank sends the whole tensors its
``iter_full()`` yields, and a tensor several ranks own is a replica, each byte sent by one of them.
Rank 0 hands its endpoint out and each round's checks are agreed over torch.distributed
(``init_info.group``, default: the default group), so every rank refuses alike, before any byte moves
and before the workers' round starts: a name owned by no rank of the job, a name declared twice, a
metadata that differs between ranks (e.g. another shape or layout on rank 1), a tensor that is not what
the metadata declares, or a piece whose shape is not what its placements give that rank, each named.
The workers are unchanged. Transforms (FP8) with several ranks are ``publisher.transforms`` of the
config every rank loads (a dict config gets ``init_info.transforms`` there): each rank transforms its
own pieces (ParamCast refuses a piece a rule cannot apply to, e.g. ``fp8: block`` on a box whose edges
are not on multiples of 128, naming the tensor and box, before any byte moves). With ``ranks`` = 1,
rank 0 sends everything as before, and a metadata giving a name only to other ranks is refused naming
it.

FP8 (docs/transforms.md): ``ParamCastTrainerInitInfo.transforms`` (rules as
``publisher.transforms`` takes them, e.g. ``[{"match": "*proj.weight", "fp8":
"block"}]``; None: the publisher config's) applies to every round
``send_weights`` sends. They are init info, not a ``send_weights`` argument,
because vLLM's contract puts a full-resync backend's wire parameters in its
``TrainerInitInfo``, which the sender passes on to the workers at the
handshake: the workers get them as ``init_info.transforms``. The static form
takes them per call (``ParamCastTrainerSendWeightsArgs.transforms``). On the
whole-tensor path, an FP8 tensor reaches ``model.load_weights`` as a
``torch.float8_e4m3fn`` tensor under its checkpoint name and its scales as
float32 ``<name>_scale_inv`` (for ``fp8: block``, ``[ceil(rows/128),
ceil(cols/128)]``: what vLLM's block-FP8 layers load, DeepSeek-V3's names),
bit for bit the publisher's quantization; ``update_info.names`` lists the
scales too, so a round whose scales did not arrive fails. Slices do not take
FP8 (``vllm_slices.py``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import paramcast

from .vllm_base import BACKEND, DEFAULT_TIMEOUT_S, _check_rules, _TrainerBase, _TrainerInitInfoBase, wire_names

# The backend's one logger, as before the trainer side had its own file.
_log = logging.getLogger("paramcast.integrations.vllm")


@dataclass
class ParamCastTrainerSendWeightsArgs:
    publisher: Any  # a started paramcast.Publisher
    manifest: Any = None  # (name, dtype, shape) triples or a module: streams the update
    version: Any = None
    transforms: Any = None  # the update's transform rules (docs/transforms.md); None: the publisher config's


# ---- trainer side (vLLM >= 0.28) ----------------------------------------------------------------
@dataclass
class ParamCastTrainerInitInfo(_TrainerInitInfoBase):
    """The trainer's ParamCast config (publisher and data plane) and the engines' config."""

    backend: ClassVar[str] = BACKEND
    config: Any = None  # dict or YAML path: the publisher's config (publisher.subscribers = the vLLM workers)
    engine_config: Any = None  # dict: the subscribers' config sent to every vLLM worker
    worker_id_prefix: str = "vllm"
    # The endpoint the workers connect to, when the publisher binds a wildcard (tcp://0.0.0.0:PORT or
    # tcp://*:PORT): tcp://<this host's address>:PORT. Default: the publisher's bound endpoint.
    advertise_endpoint: Any = None
    # How long each worker waits for a round (update_info.timeout_s); with a dict config that sets no
    # publisher.update_timeout, also the publisher's cap on the update. Keep it under the client's
    # timeout (vLLM's HTTPVLLMWeightSyncClient: 300 s) so that the workers' reason is what the trainer sees.
    update_timeout_s: float = DEFAULT_TIMEOUT_S
    # How send_weights sends a round. "stream": one tensor at a time (a sharded trainer gathers one at a
    # time). "whole": every tensor at once through weight_update, which goes point to point to workers
    # that serve slices (tensor parallelism), each receiving only its slices. "auto": streams until the
    # publisher says a worker serves slices, then "whole" from that round on.
    send: str = "auto"
    # More fields of the workers' ParamCastInitInfo, e.g. {"slices": "off"} or {"whole_fallback": True}.
    engine_init: Any = None
    # What every round sends instead of the trainer's bytes (docs/transforms.md), e.g.
    # [{"match": "*norm*", "keep": True}, {"match": "*proj.weight", "fp8": "block"}]: the workers' load_weights
    # gets <name> as float8 e4m3fn and <name>_scale_inv. [] sends every tensor as it is; None: the
    # publisher config's (publisher.transforms). The workers are told them (init_info.transforms). With
    # ranks > 1 they become the publisher.transforms of the (dict) config every rank loads: each rank
    # transforms its own pieces.
    transforms: Any = None
    # How many trainer ranks publish each round together (ParamCast's many senders): 1 (default), rank 0
    # sends every tensor the source declares; M > 1, every rank 0..M-1 sends the parameters it owns
    # (ParamMeta.owners; None: every rank), its own pieces where the source has iter_local (see iterate),
    # and the plan takes each byte from one of its holders. With a
    # dict config, publisher.ranks is set from it (a YAML config must say publisher.ranks: M itself).
    ranks: int = 1
    # With ranks > 1: the torch.distributed group of the trainer ranks (group rank = TrainerInitInfo.rank),
    # over which rank 0's endpoint is handed out and each round's holdings are checked; None: the default
    # group (what vLLM's ModuleSource assumes).
    group: Any = None
    # With ranks > 1, which of the source's iterations each rank sends from. "auto": iter_local() (each
    # rank's piece as ParamMeta.placements lay it out, no gather) when the source implements it, else
    # iter_full(). "local": iter_local(), refusing a source without it. "full": iter_full() (whole
    # tensors: an FSDP source gathers each one), e.g. for "fp8: tensor", which needs the whole tensor.
    iterate: str = "auto"

    def __post_init__(self):
        _check_rules(self.transforms, "paramcast trainer init_info.transforms")
        r = self.ranks
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"paramcast trainer init_info.ranks: expected a number of trainer ranks >= 1, got {r!r}")
        if r > 1 and not 0 <= self.rank < r:
            raise ValueError(f"paramcast trainer init_info.rank {self.rank}: not one of the {r} trainer ranks "
                             f"(init_info.ranks)")
        if r > 1 and self.transforms is not None and self.config is not None and not isinstance(self.config, dict):
            raise ValueError("paramcast trainer init_info.transforms: with several trainer ranks (init_info.ranks "
                             "> 1) every rank applies the publisher.transforms of the config it loads; a YAML "
                             "config keeps its own: pass the config as a dict (e.g. yaml.safe_load of the file), "
                             "whose publisher.transforms these rules then become")
        if self.iterate not in ("auto", "local", "full"):
            raise ValueError(f"paramcast trainer init_info.iterate: expected 'auto', 'local' or 'full', "
                             f"got {self.iterate!r}")
        if self.send not in ("auto", "stream", "whole"):
            raise ValueError(f"paramcast trainer init_info.send: expected 'auto', 'stream' or 'whole', "
                             f"got {self.send!r}")
        t = self.update_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ValueError(f"paramcast trainer init_info.update_timeout_s: expected a positive number of seconds, "
                             f"got {t!r}")


class ParamCastTrainerWeightTransferEngine(_TrainerBase):
    """The trainer's side: rank 0 publishes; with ``ranks`` > 1 every rank sends its part, else the other
    trainer ranks take part in the source's gathers only."""

    init_info_cls = ParamCastTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, rank=0, publisher=None):
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.rank = rank
        self.publisher = publisher  # rank 0: the Publisher; with ranks > 1, ranks 1..M-1: their PublisherRank
        self.ranks = 1  # trainer ranks sending each round together (init_info.ranks)
        self.group = None  # with ranks > 1: their torch.distributed group (None: the default group)
        self.update_timeout_s = DEFAULT_TIMEOUT_S
        self.send = "auto"
        self.transforms = None  # passed to every round's update (None: the publisher config's)
        self._rules = None  # the rules in effect, where known: the scales' names for update_info.names
        self.iterate = "auto"  # with ranks > 1: the source's iter_local ("auto", "local") or iter_full

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """On every trainer rank. The sender binds the publisher, has every vLLM worker join, forms the group.

        With ``init_info.ranks`` > 1 every trainer rank takes part: rank 0 hands its endpoint to the
        others over ``init_info.group`` and each of them joins it as a ParamCast PublisherRank."""
        if init_info.ranks > 1:
            return cls._trainer_init_ranks(init_info, client, source)
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False, rank=init_info.rank)
        config = init_info.config
        if isinstance(config, dict) and "update_timeout" not in (config.get("publisher") or {}):
            config = dict(config, publisher={**(config.get("publisher") or {}),
                                             "update_timeout": f"{int(init_info.update_timeout_s * 1000)}ms"})
        rules = init_info.transforms
        publisher = paramcast.Publisher(config)
        try:
            if rules is None:  # the config's publisher.transforms, whatever form it came in
                rules = publisher.config.transforms or None
            endpoint = init_info.advertise_endpoint or publisher.endpoint
            if init_info.advertise_endpoint:
                port = publisher.endpoint.rsplit(":", 1)[1]
                endpoint = endpoint.replace(":PORT", ":" + port)
            client.init_weight_transfer_engine({**(init_info.engine_init or {}),
                                                "endpoint": endpoint,
                                                "config": init_info.engine_config,
                                                "worker_id_prefix": init_info.worker_id_prefix,
                                                "transforms": None if rules is None else list(rules)})
            publisher.start()
        except BaseException:
            publisher.close()
            raise
        engine = cls(client=client, source=source, is_sender=True, rank=init_info.rank, publisher=publisher)
        engine.update_timeout_s = init_info.update_timeout_s
        engine.send = init_info.send
        engine.transforms = None if init_info.transforms is None else list(init_info.transforms)
        engine._rules = rules
        return engine

    @classmethod
    def _trainer_init_ranks(cls, init_info, client, source):
        dist, src = _trainer_group(init_info)
        ranks = init_info.ranks
        config = init_info.config
        if isinstance(config, dict):
            pub = dict(config.get("publisher") or {})
            if pub.get("ranks", ranks) != ranks:
                raise ValueError(f"paramcast trainer init_info.ranks {ranks} but config publisher.ranks "
                                 f"{pub['ranks']}: they must agree")
            # Every rank applies the config's publisher.transforms to its own pieces (ParamCast requires
            # them alike on every rank): init_info.transforms become them.
            if init_info.transforms is not None:
                pub["transforms"] = list(init_info.transforms)
            pub["ranks"] = ranks
            pub.setdefault("update_timeout", f"{int(init_info.update_timeout_s * 1000)}ms")
            config = dict(config, publisher=pub)
        rules = None  # publisher.transforms of the config each rank loaded (below)
        box = [None]
        publisher = None
        if init_info.rank == 0:
            try:
                publisher = paramcast.Publisher(config)
                rules = publisher.config.transforms or None
                endpoint = init_info.advertise_endpoint or publisher.endpoint
                if init_info.advertise_endpoint:
                    endpoint = endpoint.replace(":PORT", ":" + publisher.endpoint.rsplit(":", 1)[1])
                box = [endpoint]
            except BaseException as e:
                box = [f"error: trainer rank 0 could not bind its publisher: {e}"]
                dist.broadcast_object_list(box, src=src, group=init_info.group)
                raise
            dist.broadcast_object_list(box, src=src, group=init_info.group)
            try:
                client.init_weight_transfer_engine({**(init_info.engine_init or {}),
                                                    "endpoint": endpoint,
                                                    "config": init_info.engine_config,
                                                    "worker_id_prefix": init_info.worker_id_prefix,
                                                    "transforms": None if rules is None else list(rules)})
                publisher.start()  # waits for the workers and for trainer ranks 1..M-1
            except BaseException:
                publisher.close()
                raise
        else:
            dist.broadcast_object_list(box, src=src, group=init_info.group)
            endpoint = box[0]
            if not isinstance(endpoint, str) or endpoint.startswith("error: "):
                raise RuntimeError(f"paramcast trainer rank {init_info.rank}: no endpoint from trainer rank 0 "
                                   f"({endpoint})")
            from paramcast._config import load_config
            publisher = paramcast.PublisherRank(load_config(config).with_endpoint(endpoint), init_info.rank)
            try:
                rules = publisher.config.transforms or None
                publisher.start()
            except BaseException:
                publisher.close()
                raise
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0, rank=init_info.rank,
                     publisher=publisher)
        engine.update_timeout_s = init_info.update_timeout_s
        engine.ranks = ranks
        engine.group = init_info.group
        engine.send = "whole"
        engine.iterate = init_info.iterate
        engine.transforms = None if rules is None else list(rules)
        engine._rules = rules
        return engine

    def send_weights(self):
        """One round: start, stream every tensor of the source while the workers receive, finish.

        ``finish_weight_update`` is given the ParamCast version as ``weight_version`` (a decimal string):
        vLLM sets its engine's weight version from it (``/weight_info``, ``LLM.get_weight_version()``).
        """
        if self.ranks > 1:  # from iter_full or iter_local, whichever the source has: checked in the agreement
            return self._send_owned()
        missing = [a for a in ("metadata", "iter_full") if not hasattr(self.source, a)]
        if missing:
            raise TypeError(f"paramcast send_weights: the source ({type(self.source).__name__}) has no "
                            f"{' or '.join(missing)}: pass a vLLM WeightSource (e.g. ModuleSource(model))")
        not_ours = [m.name for m in self.source.metadata if getattr(m, "owners", None) is not None
                    and 0 not in m.owners]
        if not_ours:  # identical metadata on every rank: every rank refuses alike, before any collective
            raise ValueError(f"paramcast send_weights: trainer rank 0 sends every round alone (init_info.ranks "
                             f"is 1) but does not own {_names_list(not_ours)} (ParamMeta.owners): give "
                             f"ParamCastTrainerInitInfo ranks = the number of trainer ranks, so that each "
                             f"sends what it owns")
        if not self.is_sender:
            for _ in self.source.iter_full():  # collective gathers need every rank
                pass
            return None
        manifest = [(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata]
        self.client.start_weight_update()
        opened = None
        if self.send != "whole":
            try:
                opened = self.publisher.stream(manifest, transforms=self.transforms)
            except paramcast.UpdateError as e:
                # ParamCast refuses to stream to a worker that registered slices: those go point to point.
                if self.send == "stream" or "serves slices" not in str(e):
                    with contextlib.suppress(Exception):
                        self.client.finish_weight_update()
                    raise
                _log.info("paramcast: the vLLM workers serve slices (tensor parallelism): each round is sent "
                          "whole, point to point, each worker receiving only its slices")
                self.send = "whole"
            except BaseException:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
                raise
        if opened is None:
            return self._send_whole(manifest)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            receiving = None
            try:
                with opened as update:
                    receiving = pool.submit(self.client.update_weights,
                                            {"version": update.version, "names": self._names(manifest),
                                             "timeout_s": self.update_timeout_s})
                    for name, tensor in self.source.iter_full():
                        if receiving.done() and receiving.exception() is not None:
                            break  # the workers gave up: their error says why (raised below)
                        update.send(name, tensor)
            except BaseException:
                if receiving is None:
                    # The workers are inside a round that nothing will end: close it (vLLM restores the
                    # previous weights when a layerwise reload received nothing), then report.
                    with contextlib.suppress(Exception):
                        self.client.finish_weight_update()
                    raise
                receiving.result()  # the workers' error first: it says what went wrong where
                raise
            receiving.result()
        self.client.finish_weight_update(weight_version=str(update.version))
        return update.result

    def _send_whole(self, manifest):
        # One weight_update: to workers that registered slices, the plan sends each only its slices. Its
        # version is assigned when it is submitted; the workers wait for the next one applied (a version
        # a failed update used is not applied, so the last applied + 1 is where they start waiting).
        try:
            tensors = list(self.source.iter_full())
            version = self.publisher.status()["version"] + 1
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
            raise
        held = [tensors]  # handed over: freed once the publisher is done with them
        del tensors
        return self._round(version, self._names(manifest),
                           lambda: self.publisher.weight_update(held.pop(), transforms=self.transforms))

    def _send_owned(self):
        # Many senders: every trainer rank sends what it owns, one version together. Everything that can
        # be refused is checked on every rank and agreed over the trainer group (twice: before iterating
        # and after) before any RPC's round begins its transfer, so that every rank refuses alike and no
        # byte moves. A source that raises inside a collective of its own still leaves the others there.
        dist, _ = _trainer_group(self)
        try:  # whatever this raises on one rank, every rank still reaches the first agreement
            if not hasattr(self.source, "metadata"):
                raise TypeError(f"the source ({type(self.source).__name__}) has no metadata: pass a vLLM "
                                "WeightSource (e.g. ModuleSource(model))")
            metas = list(self.source.metadata)
            problems = _owner_problems(metas, self.ranks)
            declared = {}
            for m in metas:
                declared.setdefault(m.name, m)
            mine = [m.name for m in metas
                    if _owners(m, self.ranks) is not None and self.rank in _owners(m, self.ranks)]
            local, why = _iteration(self.source, self.iterate)
            if why:
                problems.append(f"trainer rank {self.rank}: {why}")
            rows = [(m.name, str(m.dtype), tuple(m.shape), m.owners, _layout(m)) for m in metas]
        except Exception as e:  # noqa: BLE001: every rank is told, then it is raised
            metas, declared, mine, local, rows = [], {}, [], False, None
            problems = [f"trainer rank {self.rank}: reading its source's metadata raised {type(e).__name__}: {e}"]
        # First agreement, before any rank iterates: a source may run collectives while it iterates
        # (iter_full gathers; vLLM's iter_local gathers pieces it cannot hand out as they are), which
        # every rank must join, so a rank that refuses must not leave the others inside one. Layout,
        # transforms and how each rank iterates are compared here.
        said = [None] * self.ranks
        dist.all_gather_object(said, (self.rank, problems, "iter_local" if local else "iter_full", rows, self._rules),
                               group=self.group)
        everyone = list(dict.fromkeys(p for _, ps, _, _, _ in said for p in ps))  # metadata problems: on every rank
        for rank, ps, how, theirs, rules in said[1:]:
            if ps or said[0][1]:
                continue  # refused already: their rows may not be there to compare
            if theirs != said[0][3]:
                everyone.append(_metadata_difference(said[0][3], theirs, rank))
            if rules != said[0][4]:
                everyone.append(f"trainer ranks 0 and {rank} apply different transforms (rank 0 {said[0][4]}, "
                                f"rank {rank} {rules}): give every rank the same init_info.transforms")
            if how != said[0][2]:
                everyone.append(f"trainer ranks 0 and {rank} would iterate their sources differently (rank 0 "
                                f"{said[0][2]}, rank {rank} {how}): give every rank the same init_info.iterate "
                                "and sources of one kind")
        if everyone:
            raise ValueError("paramcast send_weights refused before any byte moved: " + "; ".join(everyone))
        problems, tensors = [], []
        try:
            got = set()
            for name, tensor in (self.source.iter_local() if local else self.source.iter_full()):
                got.add(name)
                m = declared.get(name)
                if m is None or self.rank not in (_owners(m, self.ranks) or ()):
                    problems.append(f"trainer rank {self.rank} yields {name!r}, which the metadata does not "
                                    f"give it (owners {None if m is None else m.owners})")
                elif local:
                    said_piece, piece = self._piece(m, tensor)
                    if said_piece:
                        problems.append(said_piece)
                    else:
                        tensors.append((name, piece))
                elif tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
                    problems.append(f"trainer rank {self.rank} holds {name!r} as {tensor.dtype} "
                                    f"{tuple(tensor.shape)}, declared {m.dtype} {tuple(m.shape)}")
                else:
                    tensors.append((name, tensor))
            lost = [n for n in mine if n not in got]
            if lost:
                problems.append(f"trainer rank {self.rank} owns {_names_list(lost)} but its source did not "
                                "yield them")
        except Exception as e:  # noqa: BLE001: every rank is told, then it is raised
            problems.append(f"trainer rank {self.rank}: iterating its source raised {type(e).__name__}: {e}")
        version = started = None
        if self.is_sender and not problems:
            try:
                version = self.publisher.next_version()  # above any version a failed round reserved
                self.client.start_weight_update()
                started = True
            except Exception as e:  # noqa: BLE001
                problems.append(f"trainer rank 0: start_weight_update failed: {type(e).__name__}: {e}")
        # Second agreement: what iterating found, and the version rank 0 took.
        said = [None] * self.ranks
        dist.all_gather_object(said, (self.rank, problems, version), group=self.group)
        everyone = list(dict.fromkeys(p for _, ps, _ in said for p in ps))
        version = said[0][2]
        if everyone:
            tensors.clear()  # not kept alive by the exception's frame
            if started:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
            raise ValueError("paramcast send_weights refused before any byte moved: " + "; ".join(everyone))
        if not self.is_sender:
            try:
                return self.publisher.weight_update(tensors, version=version)
            finally:
                del tensors
        names = wire_names([m.name for m in metas], self._rules)  # each FP8 tensor with its scales
        held = [tensors]
        del tensors
        return self._round(version, names, lambda: self.publisher.weight_update_sharded(held.pop(), version=version))

    def _round(self, version, names, publish):
        """One update while the workers receive it: ``publish()`` (the publisher's call) beside the workers'
        ``update_weights`` RPC, then ``finish_weight_update``. On failure the workers' error comes first: it
        says what went wrong where."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            receiving = pool.submit(self.client.update_weights,
                                    {"version": version, "names": names, "timeout_s": self.update_timeout_s})
            try:
                result = publish()
            except BaseException:
                receiving.result()
                raise
            receiving.result()
        self.client.finish_weight_update(weight_version=str(result.version))
        return result

    def _piece(self, meta, tensor):
        """(refusal, None) or (None, what this rank sends of ``meta``): ``tensor``, the piece its
        ``iter_local()`` yielded, checked against the box the metadata's layout gives this rank."""
        if hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh"):  # a DTensor: its local piece
            tensor = tensor.to_local()
        shape = tuple(meta.shape)
        try:
            offsets, lengths = paramcast.reshard.piece_of(shape, meta.owners, getattr(meta, "mesh_shape", None),
                                                         getattr(meta, "placements", None), self.rank,
                                                         f"{meta.name!r}")
        except ValueError as e:
            return f"trainer rank {self.rank}: {e}", None
        if tensor.dtype != meta.dtype:
            return (f"trainer rank {self.rank} holds its piece of {meta.name!r} as {tensor.dtype}, declared "
                    f"{meta.dtype}"), None
        if tuple(tensor.shape) != tuple(lengths):
            mesh, placements = _layout(meta)
            laid = ("owners None: every rank holds it whole" if meta.owners is None else
                    f"owners {tuple(meta.owners)}, no placements: every owner holds it whole" if placements is None
                    else f"owners {tuple(meta.owners)}, mesh {mesh}, placements [{', '.join(placements)}]")
            return (f"trainer rank {self.rank} yields a piece of {meta.name!r} shaped {tuple(tensor.shape)}, but "
                    f"its layout ({laid}) gives rank "
                    f"{self.rank} {tuple(lengths)} at offsets {tuple(offsets)} of {meta.dtype} {shape}"), None
        if list(lengths) == list(shape):
            return None, tensor  # the whole tensor (a replica)
        return None, paramcast.reshard.Shard(tensor, shape, offsets)

    def _names(self, manifest):
        # What the workers must receive this round: the source's names, each FP8 one with its scales.
        return wire_names([n for n, _, _ in manifest], self._rules)

    def shutdown(self):
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.close()


def _names_list(names, most=5):
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _owners(meta, ranks):
    """The trainer ranks that own ``meta`` (ParamMeta.owners; None: every one of ``ranks``)."""
    owners = getattr(meta, "owners", None)
    return tuple(range(ranks)) if owners is None else tuple(owners)


def _owner_problems(metas, ranks):
    """What in the (identical on every rank) metadata no round of ``ranks`` trainer ranks can send."""
    problems, seen = [], {}
    for m in metas:
        owners = _owners(m, ranks)
        outside = [r for r in owners if not 0 <= r < ranks]
        if not owners or len(outside) == len(owners):
            problems.append(f"{m.name!r} is owned by no trainer rank (owners {m.owners}, the job has ranks "
                            f"0..{ranks - 1})")
        elif outside:
            problems.append(f"{m.name!r} names owners {outside} outside the job's ranks 0..{ranks - 1}")
        first = seen.setdefault(m.name, m)
        if first is not m:
            problems.append(f"{m.name!r} is declared twice: {first.dtype} {tuple(first.shape)} owned by "
                            f"{_owners(first, ranks)}, {m.dtype} {tuple(m.shape)} owned by {owners}")
    return problems


def _iteration(source, iterate):
    """(True: iter_local, False: iter_full; why neither can be used or '') for ``init_info.iterate``."""
    has = {what: _implements(source, what) for what in ("iter_local", "iter_full")}
    if iterate == "full" or (iterate == "auto" and not has["iter_local"]):
        if has["iter_full"]:
            return False, ""
        return False, (f"its source ({type(source).__name__}) implements neither iter_full nor iter_local"
                       if iterate == "auto" else f"init_info.iterate is 'full' but its source "
                       f"({type(source).__name__}) does not implement iter_full")
    if has["iter_local"]:
        return True, ""
    return True, (f"init_info.iterate is 'local' but its source ({type(source).__name__}) does not implement "
                  f"iter_local")


def _implements(source, what):
    """Whether ``source`` has its own ``what`` (vLLM's WeightSource.implements_<what>() where it has one)."""
    said = getattr(source, "implements_" + what, None)
    if callable(said):
        return bool(said())
    return callable(getattr(source, what, None))


def _layout(meta):
    """(mesh_shape, placements) of ``meta`` as plain data, compared between ranks; (None, None) for a tensor
    every owner holds whole (no placements: the mesh says nothing then)."""
    mesh, placements = getattr(meta, "mesh_shape", None), getattr(meta, "placements", None)
    if placements is None or getattr(meta, "owners", None) is None:
        return None, None
    if mesh is None:
        mesh = (len(meta.owners),)  # vLLM's default: a 1-d mesh over the owners
    placements = tuple(f"Shard({p.dim})" if type(p).__name__ == "Shard" and hasattr(p, "dim") else
                       "Replicate()" if type(p).__name__ == "Replicate" else repr(p) for p in placements)
    return tuple(mesh), placements


def _metadata_difference(ours, theirs, rank):
    """Where trainer rank ``rank``'s metadata differs from rank 0's (vLLM: identical on every rank)."""
    a, b = {e[0]: e for e in ours}, {e[0]: e for e in theirs}
    for name in list(a) + [n for n in b if n not in a]:
        if a.get(name) != b.get(name):
            def say(e):
                if e is None:
                    return "does not declare it"
                laid = "" if e[4] == (None, None) else f" on mesh {e[4][0]} as [{', '.join(e[4][1])}]"
                return f"declares {e[1]} {e[2]} owned by {e[3]}{laid}"
            return (f"trainer ranks 0 and {rank} declare {name!r} differently: rank 0 {say(a.get(name))}, "
                    f"rank {rank} {say(b.get(name))}")
    return f"trainer rank {rank} declares the parameters in another order than rank 0"


def _trainer_group(info):
    """torch.distributed (initialized) and the global rank of trainer rank 0 in ``info.group``."""
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("paramcast: several trainer ranks (init_info.ranks > 1) agree over torch.distributed: "
                           "initialize its default process group (or pass init_info.group) first")
    src = 0 if info.group is None else dist.get_global_rank(info.group, 0)
    return dist, src
