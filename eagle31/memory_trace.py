"""The bytes a training step's tensors hold, traced on the meta device (docs/performance.md, the memory estimate)."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from eagle31 import loss, ttt
from eagle31.config import DrafterConfig
from eagle31.data.batch import FeatureBatch
from eagle31.kernels import causal as kernels
from eagle31.kernels.causal import BlockwiseCausal, CausalMask, FlashCausal, resolve_backend
from eagle31.kernels.flash_cuda import flash_cuda_call_bytes
from eagle31.kernels.ttt_attention import AttentionBackend
from eagle31.loss import TargetHead, step_scales, weighted_loss
from eagle31.model import Eagle31Drafter
from eagle31.sequence_parallel import SequenceGroup, shard_length
from eagle31.trainer import DrafterObjective, TrainConfig, prepare_batch

SMALL = 1 << 12  # float tensors of up to this many elements carry their values (step scales, loss sums)
INDEX = 1 << 20  # integer and boolean ones of up to this many (token ids, documents, masks of queries; not a kernel's)
META = torch.device("meta")
_EAGLE31 = str(Path(__file__).resolve().parent)
# the causal kernels' calls, which count the phases of a step: (FlashCausal's, which differ by device; backward)
_KERNEL_CALLS = {
    getattr(kernel, name).__code__: (kernel is FlashCausal, name == "backward")
    for kernel in (FlashCausal, BlockwiseCausal)
    for name in ("forward", "backward")
}
_aten = torch.ops.aten
# operations whose output's values do not depend on their inputs' values
_VALUE_FREE = {
    getattr(_aten, name).default
    for name in ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full")
} | {_aten.new_empty_strided.default}


@functools.cache
def _makes_new_tensors(func) -> bool:
    """An operation that writes no input and returns no view of one."""
    return not func._schema.is_mutable and all(r.alias_info is None for r in func._schema.returns)


@functools.cache
def _is_eagle31(code) -> bool:
    return code.co_filename.startswith(_EAGLE31)


def _shape_key(x):
    """What a meta kernel reads of its arguments: tensors' shapes, strides, dtypes and devices, and plain values."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.is_meta)
    if type(x) is list or type(x) is tuple:
        return tuple(map(_shape_key, x))
    hash(x)
    return x


def _again(x):
    """A new meta tensor of `x`'s shape, strides and dtype; anything else as it is."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META) if isinstance(x, torch.Tensor) else x


class _Unknown(Exception):
    """A value the trace does not know."""


def _keeps_values(t: torch.Tensor) -> bool:
    return t.numel() <= (SMALL if t.is_floating_point() else INDEX)


def _tensors(args, kwargs=None) -> list[torch.Tensor]:
    """The tensors of an operation's arguments or outputs (tensors, and lists or tuples of them)."""
    found = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif type(x) is list or type(x) is tuple:
            found.extend(y for y in x if isinstance(y, torch.Tensor))
    return found


class StepTrace(TorchDispatchMode):
    """Bytes of the meta tensors made while active: `live`, `peak`, each moment's (`moments`; `unit`: the length of
    per-token dimensions); small and integer tensors' `values`; `cuda`: FlashCausal counted as on CUDA."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing is compiled in a trace; the guard would cost a tenth of it

    def __init__(self, cuda: bool = False, unit: int | None = None, slack: int = 0, shapes: dict | None = None):
        super().__init__()
        self.cuda, self.unit, self.slack = cuda, unit, slack
        self.values = WeakTensorKeyDictionary()  # meta tensor -> its values, a CPU tensor
        self.live = self.peak = 0
        self.moments: dict[tuple, int] = {}
        self._sizes: dict[int, int] = {}  # storage -> bytes, while a tensor holds it
        self._shapes = {} if shapes is None else shapes  # an operation's arguments -> its outputs' shapes (`_meta`)
        self._classes: dict = {}  # shape -> `_shape_class`
        self._refs: dict[int, weakref.ref] = {}  # storage -> a weak reference that frees its bytes
        self._unknown: dict[int, torch.UntypedStorage] = {}  # value storages written with unknown values
        self._calls = 0  # kernel calls begun: the step's phase
        self._call: int | None = None  # the kernel call running (its frame's id)
        self._held: int | None = None  # inside a FlashCausal call on CUDA: the bytes it holds
        self._runs: int | None = None  # inside a kernel call: the size of its documents' runs

    # ------------------------------------------------------------------ values

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The values of `t` (a CPU tensor: itself), None where the trace does not know them."""
        if not t.is_meta:
            return t
        v = self.values.get(t)
        return None if v is None or v.untyped_storage().data_ptr() in self._unknown else v

    def held(self, *tensors: torch.Tensor) -> int:
        """Bytes of the storages of `tensors` that the trace counts."""
        return sum(self._sizes.get(k, 0) for k in {t.untyped_storage()._cdata for t in tensors})

    # ------------------------------------------------------------------ operations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        if not _makes_new_tensors(func) and all(t.is_meta and not _keeps_values(t) for t in inputs):
            return func(*args, **kwargs)  # a view or an in-place result of large float tensors: no new bytes, no values
        calls = self._calls
        site = self._enter(sys._getframe(1))
        if not any(t.is_meta for t in inputs) and kwargs.get("device") != META:
            if inputs or self._held is None or "device" not in kwargs:
                return func(*args, **kwargs)  # work on index values (CPU): no device memory
            kwargs = {**kwargs, "device": META}  # the CPU path's own tensors inside a call counted as on CUDA
        out = self._run(func, args, kwargs)
        outputs = _tensors((out,))
        made = self._track(outputs, inputs)
        now = self.live if self._held is None else self._held
        self.peak = max(self.peak, now)
        if self.unit is not None and (made or calls != self._calls):  # only a new tensor or call raises the bytes
            key = (self._calls, site, func, *[(t.dtype, self._shape_class(t.shape)) for t in inputs + outputs])
            self.moments[key] = max(self.moments.get(key, 0), now)
        return out

    def _shape_class(self, shape: torch.Size) -> tuple[int, ...]:
        """Per dimension, m where it is m times the unit (give or take the slack), 0 for a fixed one."""
        if shape not in self._classes:
            ms = [round(d / self.unit) for d in shape]
            self._classes[shape] = tuple(
                m if m and abs(d - m * self.unit) <= self.slack else 0 for d, m in zip(shape, ms)
            )
        return self._classes[shape]

    def _enter(self, frame):
        """The innermost eagle31 line running the operation; a kernel call that begins counts a phase."""
        site = call = None
        for _ in range(8):  # a kernel's own operations run a few calls below it
            if frame is None:
                break
            code = frame.f_code
            if code in _KERNEL_CALLS:
                call = frame
                break
            if site is None and _is_eagle31(code):
                site = (code, frame.f_lineno)
            frame = frame.f_back
        if call is None and self._call is not None:  # deeper below the running call, or past its end
            while frame is not None and id(frame) != self._call:
                frame = frame.f_back
            call = frame
        if call is None:
            self._call = self._held = self._runs = None
        elif id(call) != self._call:
            self._call, self._calls = id(call), self._calls + 1
            flash, backward = _KERNEL_CALLS[call.f_code]
            a = call.f_locals
            self._runs = a["segments"].numel()
            if flash and self.cuda:
                others = (a["v"], a["dout"], a["out"]) if backward else (a["v"],)
                self._held = self.live + flash_cuda_call_bytes(backward, a["q"], a["k"], *others)
        return site

    def _run(self, func, args, kwargs) -> Any:
        """`func`'s result on the meta device."""
        try:
            out = self._meta(func, args, kwargs)
        except (NotImplementedError, RuntimeError) as e:  # its output's shape (or its value) depends on values
            try:
                real = self._compute(func, args, kwargs)
            except _Unknown:
                raise RuntimeError(f"the memory trace does not know the input values {func} needs") from e
            if kwargs.get("device", META) != META:
                return real  # the values themselves, on the CPU
            out = tree_map(_again, real)  # on the meta device with `real`'s shapes and values
            self._remember(out, real, all_values=True)
            return out
        if any(self._keeps_values(t) for t in _tensors((out,))):
            try:
                self._remember(out, self._compute(func, args, kwargs))
            except _Unknown:
                self._forget_written(func, args, kwargs)
        return out

    def _remember(self, out, real, all_values: bool = False) -> None:
        """The values `real` of the meta tensors `out` that carry values (`all_values`: every one)."""
        for t, v in zip(tree_leaves(out), tree_leaves(real)):
            if isinstance(t, torch.Tensor) and (all_values or self._keeps_values(t)):
                self.values[t] = v

    def _meta(self, func, args, kwargs):
        """`func` on the meta device; new tensors' shapes from an earlier call on same-shaped inputs, if any."""
        if not _makes_new_tensors(func):
            return func(*args, **kwargs)
        try:
            key = (func, _shape_key(args), tuple((k, _shape_key(v)) for k, v in kwargs.items()))
        except TypeError:  # an argument that is not a shape, a tensor or a plain value
            return func(*args, **kwargs)
        if key not in self._shapes:
            out = func(*args, **kwargs)
            self._shapes[key] = tree_map(_again, out)  # meta tensors of its outputs' shapes, outside the trace
            return out
        return tree_map(_again, self._shapes[key])

    def _keeps_values(self, t: torch.Tensor) -> bool:
        """Inside a kernel call only tensors no larger than its documents' runs carry values (masks' are never read)."""
        return t.is_meta and _keeps_values(t) and (self._runs is None or t.numel() <= self._runs)

    def _compute(self, func, args, kwargs):
        """`func` on the inputs' values (CPU); `_Unknown` when one is not known."""

        def real(x):
            if isinstance(x, torch.Tensor):
                v = self.value(x)
                if v is not None:
                    return v
                if func in _VALUE_FREE:  # its shape and dtype are all it reads
                    return torch.empty((), dtype=x.dtype).expand(x.shape)
                raise _Unknown
            return torch.device("cpu") if x == META else x

        rargs, rkwargs = tree_map(real, (args, kwargs))
        try:
            return func(*rargs, **rkwargs)
        except (RuntimeError, IndexError) as e:  # values made of unknown ones (an empty tensor's)
            raise _Unknown from e

    def _forget_written(self, func, args, kwargs) -> None:
        """An operation that wrote unknown values into tensors with known ones: those values are unknown now."""
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(a.name)
                v = self.values.get(t) if isinstance(t, torch.Tensor) else None
                if v is not None:
                    self._unknown[v.untyped_storage().data_ptr()] = v.untyped_storage()

    # ------------------------------------------------------------------ bytes

    def _track(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
        """Count the outputs' new storages; whether there was one."""
        known, made = None, False
        for t in outputs:
            if not t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._sizes:
                continue
            if known is None:
                known = {i.untyped_storage()._cdata for i in inputs if i.is_meta}
            if key in known:  # a view or an in-place result of a tensor made before the trace
                continue
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
            made = True
        return made

    def _free(self, key: int, _ref=None) -> None:
        self.live -= self._sizes.pop(key)
        del self._refs[key]


class _EmulatedGroup:
    """Collectives as the last of `size` ranks sees them: a gather repeats its input, a reduce-scatter's output
    is left as made."""

    def __init__(self, trace: StepTrace, size: int):
        self.trace, self.size = trace, size

    def all_gather_single(self, out: torch.Tensor, x: torch.Tensor, opts=None) -> None:
        v = self.trace.value(x)
        if v is not None:
            self.trace.values[out] = torch.cat([v] * self.size)

    def reduce_scatter_single(self, out: torch.Tensor, parts: torch.Tensor, opts=None) -> None:
        return None


# ---------------------------------------------------------------------------- one traced step


@dataclass
class StepBytes:
    """One traced step at `seq_len`: `peak`, the bytes its tensors hold at most (the batch's features left out),
    `features` the batch's aux and final states, and the peak of each moment (features the trace made included)."""

    seq_len: int
    peak: int
    features: int
    held_features: int  # the part of `features` the trace made (a sequence shard's final states and halo)
    moments: dict[tuple, int]


def attention_kernel_for(
    kernel: str, drafter: Eagle31Drafter, seq_len: int, ttt_length: int, dtype: torch.dtype, device: str
) -> str:
    """`kernel`, or for `auto` what `resolve_backend` picks on `device` at every step for `seq_len` keys."""
    if kernel != "auto":
        return kernel
    from torch._subclasses.fake_tensor import FakeTensorMode

    masks = [CausalMask(drafter.visibility, k) for k in range(ttt_length)]
    for mask in masks:
        mask.reach(seq_len)  # cached: under the fake mode below the rule is not evaluated again
    shape = (1, 1, drafter.config.num_attention_heads, drafter.config.qk_head_dim)
    with FakeTensorMode() if device != "cpu" else contextlib.nullcontext():
        q = torch.empty(shape, dtype=dtype, device=device)
        picked = {resolve_backend(q, mask, seq_len) for mask in masks}
    if len(picked) > 1:
        raise ValueError(f"train.attention_kernel=auto picks {sorted(picked)} at different TTT steps; name one")
    return picked.pop()


def trace_step(
    cfg: DrafterConfig,
    seq_len: int,
    ttt_length: int,
    *,
    activation_checkpointing: bool,
    dtype: torch.dtype,
    device: str,
    sequence_parallel: int = 1,
    attention_kernel: str = "auto",
    supervised: int | None = None,
    moments: bool = False,
    shapes: dict | None = None,
) -> StepBytes:
    """Trace one training step of one `seq_len`-token sequence (split `sequence_parallel` ways: the last rank's);
    device: `cuda` (FSDP2, parameters gathered in `dtype`) or `cpu`; supervised: the traced rank's first supervised
    positions (None: all); moments: each moment's peak; shapes: meta kernels' outputs shared by a drafter's traces."""
    K, N, T = ttt_length, sequence_parallel, seq_len
    with torch.device(META):
        drafter = Eagle31Drafter(cfg).to(dtype)
        lm_head = torch.empty(cfg.vocab_size, cfg.target_hidden_size, dtype=dtype)
        head = TargetHead(lm_head, torch.arange(cfg.draft_vocab_size))
        aux = torch.empty(1, T, cfg.fc_in_features, dtype=dtype)
        final = torch.empty(1, T, cfg.target_hidden_size, dtype=dtype)
    train = TrainConfig(
        ttt_length=K,
        activation_checkpointing=activation_checkpointing,
        attention_kernel=AttentionBackend(attention_kernel_for(attention_kernel, drafter, T, K, dtype, device)),
        mask_out_of_vocab=False,
        sequence_parallel=N,
    )
    objective = DrafterObjective(drafter, train)
    shard = shard_length(T, N, K)
    start = (N - 1) * shard
    loss_mask = torch.zeros(1, max(T, N * shard), dtype=torch.long)
    loss_mask[:, start : start + (shard if supervised is None else supervised)] = 1
    tokens = torch.zeros(1, T, dtype=torch.long)  # one document: T tokens, one sample
    batch = FeatureBatch(
        input_ids=tokens, loss_mask=loss_mask[:, :T], document_ids=tokens.clone(), aux=aux, final=final
    )
    trace = StepTrace(device == "cuda", shard if moments else None, (K + 2) ** 2 + 16, shapes)
    group = SequenceGroup(1, 0, 0, 1) if N == 1 else SequenceGroup(N, N - 1, 0, 1, _EmulatedGroup(trace, N))
    with trace:
        b, mask, argmax, sequence = prepare_batch(batch, train, head, META, dtype, group, drafter.visibility)
        count = mask.sum(dim=(1, 2)).double()
        scale = step_scales(count, train.ttt_decay)
        stats = objective(b.aux, b.input_ids, b.document_ids, b.final, mask, argmax, scale, head, sequence)
        weighted_loss(stats.loss_sum, count, train.ttt_decay).backward()
        held = trace.held(b.aux, b.final)
    return StepBytes(T, trace.peak - held, b.aux.nbytes + b.final.nbytes, held, trace.moments)


# ---------------------------------------------------------------------------- any length


@dataclass
class _Plane:
    """Each moment's bytes a + b (T - T0) + c (P - P0), P the traced rank's supervised positions; features too."""

    T0: int
    P0: int
    moments: list[tuple[float, float, float]]
    features: tuple[float, float, float]
    held: tuple[float, float, float]

    def at(self, T: int, P: int) -> tuple[int, int]:
        """(the step's peak bytes, the features' bytes)."""
        dT, dP = T - self.T0, P - self.P0
        peak = max(a + b * dT + c * dP for a, b, c in self.moments)
        features, held = (a + b * dT + c * dP for a, b, c in (self.features, self.held))
        return round(peak - held), round(features)


class StepMemory:
    """A training step's bytes at any T, every query supervised (`at`): traced, or planes (docs/performance.md)."""

    FIT_LIMIT = 8192  # positions of a shard the fit lengths need at most to run every loop of blocks steadily

    def __init__(self, cfg: DrafterConfig, ttt_length: int, **options):
        self.cfg, self.ttt_length = cfg, ttt_length
        self.options = {**options, "shapes": {}}  # the meta kernels' outputs, shared by the traces (`StepTrace`)
        self.sequence_parallel = options.get("sequence_parallel", 1)
        self._traces: dict[tuple, StepBytes] = {}
        self._planes: dict[int | None, _Plane] = {}

    def trace(self, seq_len: int, supervised: int | None = None, moments: bool = False) -> StepBytes:
        key = (seq_len, supervised, moments)
        if key not in self._traces:
            self._traces[key] = trace_step(
                self.cfg, seq_len, self.ttt_length, supervised=supervised, moments=moments, **self.options
            )
        return self._traces[key]

    def supervised_counts(self) -> tuple[int, int] | None:
        """P0 < P1, the supervised positions whose label rows (the first P - 2) fill two and three loss chunks (a second
        block beside the first's leftovers); None where 2·P1 passes `FIT_LIMIT`: every position supervised."""
        rows = self._loss_rows()
        return (2 * rows + 2, 3 * rows + 2) if 2 * (3 * rows + 2) <= self.FIT_LIMIT else None

    def _loss_rows(self) -> int:
        return max(1, loss._LOGITS_BUDGET // self.cfg.draft_vocab_size)

    def fit_lengths(self) -> tuple[int, int]:
        """T0 < T1 (multiples of the split): every loop of blocks runs alike there (docs/performance.md)."""
        cfg, P = self.cfg, self.supervised_counts()
        chain = kernels.BLOCK_BUDGET // (cfg.num_attention_heads * cfg.qk_head_dim)
        mlp = ttt.FEED_FORWARD_BUDGET // cfg.intermediate_size
        loops = [(mlp, mlp), (chain, 2 * chain)]  # (one block up to, steady from)
        if cfg.sliding_window:
            loops.append((cfg.sliding_window, 2 * cfg.sliding_window))
        if P is None:
            loops.append((self._loss_rows(), 2 * self._loss_rows() + 2))
        steady = sorted({s for _, s in loops})
        start = max([s for s in steady if s <= self.FIT_LIMIT], default=0)
        for limit in [start, *[s for s in steady if s > start]]:
            shard = 1024 * math.ceil(max(limit, 2 * P[1] if P else 1024) / 1024) + 531  # near no model dimension
            if all(one >= 2 * shard + 1 for one, s in loops if s > limit):
                break
        return self.sequence_parallel * shard, self.sequence_parallel * (2 * shard + 1)

    def at(self, seq_len: int) -> tuple[int, int]:
        """(the step's peak bytes, the batch's feature bytes) at T = `seq_len`, every query supervised."""
        shard, P = shard_length(seq_len, self.sequence_parallel, self.ttt_length), self.supervised_counts()
        T0, T1 = self.fit_lengths()
        if (P and shard <= P[1]) or (not P and seq_len <= T1):
            s = self.trace(seq_len)
            return s.peak, s.features
        return self.plane(None if seq_len >= T0 else seq_len).at(seq_len, shard)

    def plane(self, seq_len: int | None = None) -> _Plane:
        """Each moment's plane through the traces at (T0, P0), (T1, P0) and (T0, P1), T0 < T1 the fit lengths; at
        `seq_len` (T0 = `seq_len`), through two, no slope in T; where every position is supervised, no slope in P."""
        if seq_len not in self._planes:
            T0, T1 = self.fit_lengths() if seq_len is None else (seq_len, None)
            P0, P1 = self.supervised_counts() or (None, None)
            base = self.trace(T0, P0, True)
            along_T = self.trace(T1, P0, True) if T1 else None
            along_P = self.trace(T0, P1, True) if P1 else None
            traces = [t for t in (base, along_T, along_P) if t is not None]
            keys = set.intersection(*(set(t.moments) for t in traces))
            if not keys or any(max(t.moments[k] for k in keys) != t.peak + t.held_features for t in traces):
                raise RuntimeError(f"the memory trace's moments at T={T0} and {T1} do not line up")

            def through(value) -> tuple[float, float, float]:
                """(a trace's figure at (T0, P0), its slope in T, its slope in P)."""
                a = value(base)
                b = (value(along_T) - a) / (along_T.seq_len - T0) if along_T else 0.0
                return a, b, (value(along_P) - a) / (P1 - P0) if P0 and P1 else 0.0

            moments = [through(lambda t, k=k: t.moments[k]) for k in keys]
            features, held = through(lambda t: t.features), through(lambda t: t.held_features)
            self._planes[seq_len] = _Plane(T0, P0 or 0, moments, features, held)
        return self._planes[seq_len]
