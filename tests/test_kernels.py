"""Invariant 5: every Triton kernel equals its torch reference (Triton's interpreter on CPU tensors).

On a CUDA machine, `TRITON_INTERPRET=0 pytest tests/test_kernels.py` runs the same checks on the GPU.
"""

import os

import torch

# @triton.jit reads TRITON_INTERPRET when the kernel module is imported: set it before anything imports it.
if os.environ.get("TRITON_INTERPRET") != "0" or not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import ragcache.kernels as kernels  # noqa: E402
from tests.test_repair import NOT_CUT_INVARIANT  # noqa: E402
from ragcache.kernels import torch_ref  # noqa: E402

# Tolerances per dtype against the reference. fp32 agrees to rounding; RoPE in fp16/bf16 rounds where the
# reference rounds (1 ulp for a differing cos/sin ulp); attention rounds probabilities to the value dtype.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(scope="module")
def ops():
    import ragcache.kernels.triton_ops as ops

    if not ops.INTERPRET and not torch.cuda.is_available():
        # imported earlier in this process without the interpreter: rebuild its kernels for CPU tensors
        os.environ["TRITON_INTERPRET"] = "1"
        ops = importlib.reload(ops)
    return ops


@pytest.fixture(autouse=True)
def no_float_runtime_arguments(ops, monkeypatch):
    """No kernel takes a Python float as a runtime argument: eager Triton types one fp32, but Inductor (a kernel
    inside torch.compile, as `decode_compile` runs the captured step) types it fp64, which promotes the arithmetic
    it touches and fails to compile a loop that carries fp32 (the H200 run of 2026-11-29). Such a value is a
    constexpr."""
    if not ops.INTERPRET:
        yield
        return
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    floats: list[str] = []
    run = InterpretedFunction.run

    def checked(self, *args, **kwargs):
        params = inspect.signature(self.fn).parameters
        for (name, param), value in zip(params.items(), args):
            if isinstance(value, float) and "constexpr" not in str(param.annotation):
                floats.append(f"{self.fn.__name__}({name}={value})")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", checked)
    yield
    assert not floats, f"float runtime arguments (make them tl.constexpr): {sorted(set(floats))}"


@pytest.fixture(scope="module")
def device(ops):
    return torch.device("cpu" if ops.INTERPRET else "cuda")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=_gen(seed)).to(device=device, dtype=dtype)


def _rope_table(layers, half, head_dim, seed):
    """Per-layer distinct tables: alternating thetas (gemma3-like local/global), a llama3/yarn-like bent
    frequency curve on some layers, and per-layer attention scaling."""
    g = _gen(seed)
    rows = []
    for layer in range(layers):
        theta = 10_000.0 if layer % 2 == 0 else 1_000_000.0
        freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / (2 * half))
        if layer % 3 == 2:
            freq = freq * torch.linspace(1.0, 0.125, half, dtype=torch.float64)
        rows.append(freq)
    inv_freq = torch.stack(rows).to(torch.float32)
    scaling = (1.0 + 0.3 * torch.rand(layers, generator=g)).to(torch.float32)
    return inv_freq, scaling


def _close(actual, expected, dtype, magnitude=1.0):
    """Within the dtype's tolerance; `magnitude` scales atol for operands of that size (a difference of two
    products that cancels keeps the products' rounding error, not the result's)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = dict(TOL[dtype], atol=TOL[dtype]["atol"] * magnitude)
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), **tol)


def _rounds_as_the_reference(ops, actual, expected):
    """Bit-equal up to a rare ulp. Asserted where the rounding is known to be torch's: in the interpreter, which
    rounds step by step as written. Compiled for an H100, 8-24% of fp16/bf16 rotated keys and 59% of fp32 int8-decoded
    values came out an ulp off (the decode's multiply-add is fused; cos/sin equal torch's bit for bit; the keys'
    cause is not pinned down), all within the dtype's tolerance, which is what is asserted there."""
    if ops.INTERPRET:
        assert (actual.cpu() != expected.cpu()).float().mean() < 0.01


# ------------------------------------------------------------------ rotate_keys

ROTATE_CASES = [
    # layers, heads, tokens, head_dim, rotary half (half < head_dim / 2: partial rotary)
    (2, 3, 37, 64, 32),
    (3, 1, 5, 128, 24),
    (1, 2, 9, 256, 128),
    (2, 2, 70, 128, 64),
    (1, 2, 6, 80, 32),  # head_dim not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ROTATE_CASES, ids=lambda c: "L{}H{}T{}D{}r{}".format(*c))
def test_rotate_keys(ops, device, case, dtype):
    layers, heads, tokens, head_dim, half = case
    # a [L, T, H, D] buffer seen as [L, H, T, D]: strided input, as a model's cache often is
    keys = _randn(layers, tokens, heads, head_dim, dtype=dtype, device=device, seed=1).transpose(1, 2)
    positions = torch.randint(-300, 40_000, (tokens,), generator=_gen(2))
    positions[0] = -7  # negative positions rotate backwards
    positions = positions.to(device)
    inv_freq, scaling = _rope_table(layers, half, head_dim, seed=3)

    got = ops.rotate_keys(keys, positions, inv_freq.to(device), scaling.to(device))
    want = torch_ref.rotate_keys(keys, positions, inv_freq.to(device), scaling.to(device))
    _close(got, want, dtype)
    if dtype != torch.float32:  # rounds where the reference rounds: equal bits, up to a rare cos/sin ulp
        _rounds_as_the_reference(ops, got, want)
    # partial rotary: dims past the rotary ones are copied bit for bit
    assert torch.equal(got[..., 2 * half :].cpu(), keys[..., 2 * half :].cpu())


def test_rotate_keys_relative(ops, device):
    """Rotating by a then by b equals rotating by a + b (fp32): RoPE is relative, whatever the sign."""
    keys = _randn(2, 2, 11, 64, dtype=torch.float32, device=device, seed=4)
    inv_freq, _ = _rope_table(2, 32, 64, seed=5)
    one = torch.ones(2)
    a = torch.arange(-5, 6, device=device) * 3
    b = torch.full((11,), 101, device=device)
    twice = ops.rotate_keys(ops.rotate_keys(keys, a, inv_freq, one), b, inv_freq, one)
    once = ops.rotate_keys(keys, a + b, inv_freq, one)
    torch.testing.assert_close(twice, once, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ place_chunks


class _LaunchCounter:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _placed_as_the_reference(ops, monkeypatch, joined_keys, joined_values, *args) -> tuple:
    """Chunks placed through `ops` into the joined cache, and through the torch reference into a copy of it: the
    copy's keys and values, and how many launches `ops` took."""
    want_keys, want_values = joined_keys.clone(), joined_values.clone()
    counter = _LaunchCounter(ops._place_kernel)
    monkeypatch.setattr(ops, "_place_kernel", counter)
    ops.place_chunks(joined_keys, joined_values, *args)
    torch_ref.place_chunks(want_keys, want_values, *args)
    return want_keys, want_values, counter.launches


PLACE_CASES = [
    # joined dtype, chunk dtype, head_dim, rotary half, chunk lengths, starts
    (torch.float32, torch.float32, 64, 32, [13, 70, 1, 40], [3, 20, 100, 150]),
    (torch.float16, torch.float16, 128, 64, [5, 33, 17], [40, 0, 90]),  # starts not in order
    (torch.bfloat16, torch.bfloat16, 64, 16, [64, 65], [0, 64]),  # back to back, partial rotary
    (torch.float32, torch.float16, 256, 128, [3, 6], [1, 9]),  # fp16 chunks into an fp32 cache
]


@pytest.mark.parametrize("case", PLACE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-D{c[2]}-r{c[3]}-{len(c[4])}chunks")
def test_place_chunks(ops, device, monkeypatch, case):
    joined_dtype, chunk_dtype, head_dim, half, lengths, starts = case
    layers, heads, capacity = 3, 2, max(s + n for s, n in zip(starts, lengths)) + 5
    chunk_keys = [_randn(layers, heads, n, head_dim, dtype=chunk_dtype, device=device, seed=10 + i) for i, n in enumerate(lengths)]
    chunk_values = [_randn(layers, heads, n, head_dim, dtype=chunk_dtype, device=device, seed=20 + i) for i, n in enumerate(lengths)]
    # chunks as views with their own strides: a [L, T, H, D] buffer, a token slice of a longer buffer
    chunk_keys[0] = chunk_keys[0].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    chunk_values[-1] = torch.cat([chunk_values[-1], chunk_values[-1][:, :, :3]], dim=2)[:, :, : lengths[-1]]
    inv_freq, scaling = _rope_table(layers, half, head_dim, seed=6)
    inv_freq, scaling = inv_freq.to(device), scaling.to(device)
    # the cache already holds other data (system prompt, question): untouched rows must stay as they are
    joined_keys = _randn(layers, heads, capacity, head_dim, dtype=joined_dtype, device=device, seed=7)
    joined_values = _randn(layers, heads, capacity, head_dim, dtype=joined_dtype, device=device, seed=8)
    want_keys, want_values, launches = _placed_as_the_reference(
        ops, monkeypatch, joined_keys, joined_values, chunk_keys, chunk_values, starts, inv_freq, scaling
    )
    assert launches == 1  # every chunk in one launch
    _close(joined_keys, want_keys, chunk_dtype)
    if joined_dtype != torch.float32:  # rotated in the cache dtype: rounds where the reference rounds
        _rounds_as_the_reference(ops, joined_keys, want_keys)
    assert torch.equal(joined_values.cpu(), want_values.cpu())


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("joined_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,half", [(64, 32), (80, 16)])  # full and partial rotary, a head_dim not a power of 2
def test_place_chunks_decodes_integer_codes_in_the_same_pass(ops, device, monkeypatch, joined_dtype, head_dim, half, name):
    """The fused dequantize-and-place kernel against its torch reference: same unpacking, decode and rotation, one
    launch."""
    from ragcache.store import codec

    layers, heads, lengths, starts = 3, 2, [7, 70, 33], [2, 9, 79]
    capacity = max(s + n for s, n in zip(starts, lengths)) + 3
    encoded = [codec.encode(_randn(layers, heads, n, head_dim, dtype=torch.float32, device="cpu", seed=30 + i) * 4,
                            _randn(layers, heads, n, head_dim, dtype=torch.float32, device="cpu", seed=40 + i), name)
               for i, n in enumerate(lengths)]  # fmt: skip
    keys, values, key_scales, value_scales = ([e[j].to(device) for e in encoded] for j in range(4))
    inv_freq, scaling = (t.to(device) for t in _rope_table(layers, half, head_dim, seed=6))
    joined_keys = _randn(layers, heads, capacity, head_dim, dtype=joined_dtype, device=device, seed=7)
    joined_values = _randn(layers, heads, capacity, head_dim, dtype=joined_dtype, device=device, seed=8)
    want_keys, want_values, launches = _placed_as_the_reference(
        ops, monkeypatch, joined_keys, joined_values, keys, values, starts, inv_freq, scaling, key_scales, value_scales
    )
    assert launches == 1
    # the keys are 4 x randn: compiled, a cancelling difference of two rounded products keeps their rounding error
    _close(joined_keys, want_keys, joined_dtype, magnitude=1.0 if ops.INTERPRET else 4.0)
    _close(joined_values, want_values, joined_dtype)
    # fp32 decode is exact arithmetic on both sides up to one rounding (a GPU fuses the multiply-add)
    _rounds_as_the_reference(ops, joined_values, want_values)

    untouched = torch.ones(capacity, dtype=torch.bool)
    for s, n in zip(starts, lengths):
        untouched[s : s + n] = False
    assert torch.equal(joined_keys[:, :, untouched.to(device)].cpu(), want_keys[:, :, untouched.to(device)].cpu())


def test_a_prefix_as_computed_and_chunks_in_a_codec_place_in_a_launch_per_form(ops, device, monkeypatch):
    """A link's system prefix is stored as computed and its chunks in the codec ("auto": int8): one launch for the
    prefix and one for every chunk, not one a chunk (a launch each, per layer where the copies run by layers)."""
    from ragcache.store import codec

    layers, heads, head_dim, lengths, starts = 2, 2, 64, [6, 9, 12, 5], [0, 6, 15, 27]
    prefix = _randn(layers, heads, lengths[0], head_dim, dtype=torch.float32, device=device, seed=50)
    encoded = [codec.encode(_randn(layers, heads, n, head_dim, dtype=torch.float32, device="cpu", seed=51 + i),
                            _randn(layers, heads, n, head_dim, dtype=torch.float32, device="cpu", seed=61 + i), "int8")
               for i, n in enumerate(lengths[1:])]  # fmt: skip
    keys = [prefix, *(e[0].to(device) for e in encoded)]
    values = [prefix * 2, *(e[1].to(device) for e in encoded)]
    key_scales, value_scales = ([None, *(e[j].to(device) for e in encoded)] for j in (2, 3))
    inv_freq, scaling = (t.to(device) for t in _rope_table(layers, 32, head_dim, seed=6))
    joined_keys = _randn(layers, heads, 40, head_dim, dtype=torch.float32, device=device, seed=7)
    joined_values = _randn(layers, heads, 40, head_dim, dtype=torch.float32, device=device, seed=8)
    want_keys, want_values, launches = _placed_as_the_reference(
        ops, monkeypatch, joined_keys, joined_values, keys, values, starts, inv_freq, scaling, key_scales, value_scales
    )
    assert launches == 2
    _close(joined_keys, want_keys, torch.float32)
    _close(joined_values, want_values, torch.float32)


def test_place_chunks_overlap_keeps_reference_order(ops, device):
    """Overlapping targets (never produced by the linker) still end as the reference: later chunks win."""
    layers, heads, head_dim = 2, 1, 64
    inv_freq, scaling = (t.to(device) for t in _rope_table(layers, 32, head_dim, seed=9))
    lengths, starts = [20, 10, 7], [0, 15, 18]
    keys = [_randn(layers, heads, n, head_dim, dtype=torch.float32, device=device, seed=30 + i) for i, n in enumerate(lengths)]
    values = [_randn(layers, heads, n, head_dim, dtype=torch.float32, device=device, seed=40 + i) for i, n in enumerate(lengths)]
    got = [torch.zeros(layers, heads, 30, head_dim, device=device) for _ in range(2)]
    want = [torch.zeros(layers, heads, 30, head_dim, device=device) for _ in range(2)]
    ops.place_chunks(*got, keys, values, starts, inv_freq, scaling)
    torch_ref.place_chunks(*want, keys, values, starts, inv_freq, scaling)
    _close(got[0], want[0], torch.float32)
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("start", [8, -6])
def test_place_chunks_rejects_out_of_range(ops, device, start):
    """Both backends: the torch one wrote a chunk past the end into a shorter slice (growing the tensor's storage
    with a warning) and a negative start counted back from the end."""
    from ragcache.store import codec

    joined = torch.zeros(1, 1, 10, 64, device=device)
    chunk = torch.zeros(1, 1, 4, 64, device=device)
    inv_freq, scaling = _rope_table(1, 32, 64, seed=0)
    for backend in (ops, torch_ref):
        with pytest.raises(ValueError, match="outside the joined capacity"):
            backend.place_chunks(joined, joined.clone(), [chunk], [chunk], [start], inv_freq, scaling)
    codes = [t.to(device) for t in codec.encode(torch.ones(1, 1, 4, 64), torch.ones(1, 1, 4, 64), "int8")]
    with pytest.raises(ValueError, match="outside the joined capacity"):
        torch_ref.place_chunks(joined, joined.clone(), [codes[0]], [codes[1]], [start], inv_freq, scaling, [codes[2]],
                               [codes[3]])  # fmt: skip
    with pytest.raises(ValueError, match="1 key chunks, 2 value chunks"):
        torch_ref.place_chunks(joined, joined.clone(), [chunk], [chunk, chunk], [0], inv_freq, scaling)


# ------------------------------------------------------------------ selected_attention


def _legolink_positions(length, chunk, per_chunk, question):
    """Rows as LegoLink selects them: the first tokens of every chunk, then the question at the end."""
    rows = [p for start in range(0, length - question, chunk) for p in range(start, min(start + per_chunk, length - question))]
    rows += range(length - question, length)
    return torch.tensor(rows, dtype=torch.int64)


ATTENTION_CASES = [
    # q heads, kv heads, n rows, N keys, head_dim, window, dtype, rows
    (4, 4, None, 50, 64, None, torch.float32, "legolink"),  # GQA 1
    (6, 2, 19, 100, 64, 7, torch.float32, "random"),  # GQA 3, sliding window
    (8, 2, None, 150, 128, None, torch.float16, "legolink"),  # GQA 4
    (8, 2, 21, 97, 128, 33, torch.bfloat16, "random"),
    (12, 4, 37, 130, 64, None, torch.float16, "unsorted"),  # GQA 3, rows in no order
    (3, 1, 5, 71, 128, 5, torch.float32, "random"),
    (2, 1, 3, 20, 256, None, torch.float16, "random"),  # head_dim 256, tiny
    (4, 2, 4, 37, 256, 9, torch.bfloat16, "random"),
    (2, 2, 6, 45, 80, None, torch.float32, "random"),  # head_dim not a power of two
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "H{}KV{}n{}N{}D{}w{}-{}-{}".format(*c[:6], str(c[6])[6:], c[7]))
def test_selected_attention(ops, device, case):
    heads, kv_heads, rows, length, head_dim, window, dtype, kind = case
    if kind == "legolink":
        positions = _legolink_positions(length, chunk=23, per_chunk=4, question=7)
    else:
        positions = torch.randperm(length, generator=_gen(11))[:rows]
        positions[0] = 0  # a row that sees one key only
        if kind == "random":
            positions = positions.sort().values
    rows = positions.numel()
    positions = positions.to(device)
    # [n, H, D] buffer seen as [H, n, D]; K/V are a prefix view of a longer cache, as in the linker
    query = _randn(rows, heads, head_dim, dtype=dtype, device=device, seed=12).transpose(0, 1)
    keys = _randn(kv_heads, length + 9, head_dim, dtype=dtype, device=device, seed=13)[:, :length]
    values = _randn(kv_heads, length + 9, head_dim, dtype=dtype, device=device, seed=14)[:, :length]
    scale = 1.0 / math.sqrt(head_dim)

    got = ops.selected_attention(query, keys, values, positions, scale, window)
    want = torch_ref.reference_attention(query, keys, values, positions, scale, window)
    _close(got, want, dtype)


def test_selected_attention_sees_only_the_past(ops, device):
    """Changing keys/values after a row's position (or before its window) leaves that row unchanged."""
    heads, length, head_dim, window = 2, 80, 64, 10
    query = _randn(heads, 3, head_dim, dtype=torch.float32, device=device, seed=15)
    keys = _randn(1, length, head_dim, dtype=torch.float32, device=device, seed=16)
    values = _randn(1, length, head_dim, dtype=torch.float32, device=device, seed=17)
    positions = torch.tensor([5, 40, 41], device=device)
    base = ops.selected_attention(query, keys, values, positions, 0.125, window)
    keys2, values2 = keys.clone(), values.clone()
    keys2[:, 42:] += 5.0
    values2[:, 42:] -= 3.0
    keys2[:, :31] *= -2.0
    values2[:, :31] += 1.0
    moved = ops.selected_attention(query, keys2, values2, positions, 0.125, window)
    torch.testing.assert_close(moved[1:], base[1:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(moved[0], base[0])  # row at 5 saw the changed keys


# ------------------------------------------------------------------ selected_attention: the fast paths

# q heads, kv heads, first position p, rows n, head_dim, window. Keys run past p + n (a longer cache): the rows
# must not see them.
CONTIGUOUS_CASES = [
    (9, 3, 0, 70, 64, None),  # prefill from 0, GQA 3 (smollm2's shape)
    (9, 3, 40, 30, 64, None),  # a prefill piece from p > 0
    (9, 3, 77, 1, 64, None),  # a decode row
    (4, 4, 0, 1, 64, None),  # the very first row, no GQA
    (4, 1, 0, 90, 32, 16),  # windowed prefill from 0 (gemma3's local layers)
    (4, 1, 50, 40, 32, 16),  # windowed piece from p > 0
    (4, 1, 90, 1, 32, 16),  # windowed decode row
    (4, 2, 5, 20, 80, 100),  # a window wider than the prompt; head_dim not a power of two
    (8, 2, 300, 300, 128, 256),  # several blocks under a window
    (8, 2, 300, 200, 128, None),  # a piece from p whose blocks score several whole tiles unmasked before their rows
]


def _contiguous_inputs(case, dtype, device):
    heads, kv_heads, first, rows, head_dim, window = case
    query = _randn(rows, heads, head_dim, dtype=dtype, device=device, seed=31).transpose(0, 1)
    keys = _randn(kv_heads, first + rows + 9, head_dim, dtype=dtype, device=device, seed=32)
    values = _randn(kv_heads, first + rows + 9, head_dim, dtype=dtype, device=device, seed=33)
    positions = torch.arange(first, first + rows, device=device)
    return query, keys, values, positions, 1.0 / math.sqrt(head_dim), window


def _reference(query, keys, values, positions, scale, window):
    """The plain definition in fp32 on the same (rounded) inputs, over the keys the rows may see."""
    end = int(positions.max()) + 1
    return torch_ref.reference_attention(query, keys[:, :end], values[:, :end], positions, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CONTIGUOUS_CASES, ids=lambda c: "H{}KV{}p{}n{}D{}w{}".format(*c))
def test_contiguous_attention_equals_reference(case, dtype):
    """torch_ref's causal fast path (no mask, is_causal, or an offset mask; GQA without copies; no upcast)."""
    query, keys, values, positions, scale, window = _contiguous_inputs(case, dtype, torch.device("cpu"))
    got = torch_ref.selected_attention(query, keys, values, positions, scale, window, contiguous_from=case[2])
    _close(got, _reference(query, keys, values, positions, scale, window), dtype)


def test_a_piece_from_p_builds_its_mask_once_for_every_layer():
    """Every layer of a step attends its piece over the same offset mask: built once, not once a layer, and the
    answer the same as from a freshly built one."""
    query, keys, values, positions, scale, _ = _contiguous_inputs((9, 3, 40, 30, 64, None), torch.float32, "cpu")
    torch_ref._offset_causal_mask.cache_clear()
    first = torch_ref.selected_attention(query, keys, values, positions, scale, contiguous_from=40)
    for _ in range(3):  # three more layers
        again = torch_ref.selected_attention(query, keys, values, positions, scale, contiguous_from=40)
        assert torch.equal(again, first)
    info = torch_ref._offset_causal_mask.cache_info()
    assert (info.misses, info.hits) == (1, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CONTIGUOUS_CASES, ids=lambda c: "H{}KV{}p{}n{}D{}w{}".format(*c))
def test_contiguous_attention_triton(ops, device, case, dtype):
    query, keys, values, positions, scale, window = _contiguous_inputs(case, dtype, device)
    got = ops.selected_attention(query, keys, values, positions, scale, window, contiguous_from=case[2])
    _close(got, _reference(query, keys, values, positions, scale, window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [c for c in CONTIGUOUS_CASES if c[2] > 0], ids=lambda c: "H{}KV{}p{}n{}D{}w{}".format(*c))
def test_the_kernel_takes_a_piece_from_p_as_on_cuda(ops, device, case, dtype):
    """On CUDA a prefill piece from p > 0 runs in the Triton kernel, not SDPA (`sdpa_serves`): its unmasked tiles
    before the block's first row and its masked tail give the reference's rows."""
    query, keys, values, positions, scale, window = _contiguous_inputs(case, dtype, device)
    got = ops.selected_attention(query, keys, values, positions, scale, window)  # no hint: the kernel itself
    _close(got, _reference(query, keys, values, positions, scale, window), dtype)


def test_sdpa_serves_a_prefill_from_0_and_a_decode_row_and_on_cuda_no_piece_from_p(ops):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # a device object only: nothing is allocated on it
    assert ops.sdpa_serves(0, 512, 512, None, cuda) and ops.sdpa_serves(0, 512, 512, None, cpu)
    assert ops.sdpa_serves(4095, 1, 4096, None, cuda)  # a decode row
    assert not ops.sdpa_serves(3584, 512, 4096, None, cuda) and ops.sdpa_serves(3584, 512, 4096, None, cpu)
    assert not ops.sdpa_serves(None, 512, 4096, None, cpu)  # rows in any order
    assert not ops.sdpa_serves(0, 512, 512, 256, cpu)  # a window that cuts the run
    assert not ops.sdpa_serves(3584, 1024, 4096, None, cpu)  # more rows than keys: the kernel's error, not SDPA's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "H{}KV{}n{}N{}D{}w{}-{}-{}".format(*c[:6], str(c[6])[6:], c[7]))
def test_selected_rows_attention_equals_reference(case, dtype):
    """torch_ref's general path (rows in any order; GQA without copies; keys cut at a block's last row)."""
    heads, kv_heads, rows, length, head_dim, window, _, kind = case
    if kind == "legolink":
        positions = _legolink_positions(length, chunk=23, per_chunk=4, question=7)
    else:
        positions = torch.randperm(length, generator=_gen(11))[:rows]
        if kind == "random":
            positions = positions.sort().values
    query = _randn(heads, positions.numel(), head_dim, dtype=dtype, device="cpu", seed=12)
    keys = _randn(kv_heads, length, head_dim, dtype=dtype, device="cpu", seed=13)
    values = _randn(kv_heads, length, head_dim, dtype=dtype, device="cpu", seed=14)
    scale = 1.0 / math.sqrt(head_dim)
    got = torch_ref.selected_attention(query, keys, values, positions, scale, window)
    _close(got, torch_ref.reference_attention(query, keys, values, positions, scale, window), dtype)


def test_dispatcher_passes_the_contiguous_hint(monkeypatch):
    calls = []
    fast = torch_ref._contiguous_attention
    monkeypatch.setattr(torch_ref, "_contiguous_attention", lambda *a: calls.append(a[3]) or fast(*a))
    monkeypatch.setattr(kernels, "_FORCED", "torch")
    query, keys, values, positions, scale, window = _contiguous_inputs((4, 2, 6, 5, 64, None), torch.float32, "cpu")
    kernels.selected_attention(query, keys, values, positions, scale, window, contiguous_from=6)
    kernels.selected_attention(query, keys, values, positions, scale, window)
    assert calls == [6]


# ------------------------------------------------------------------ decode rows over a pool's slots

# q heads, kv heads, slots, capacity, head_dim, window, dtype, DECODE_PROGRAMS (how finely a row's keys split)
SLOT_DECODE_CASES = [
    (9, 3, 3, 96, 64, None, torch.float32, 64),  # smollm2's heads, 8 splits of 12 keys (one tile each)
    (8, 2, 2, 300, 128, None, torch.bfloat16, 16),  # llama3-8b's group of 4, capacity not a tile multiple
    (4, 4, 4, 64, 32, None, torch.float16, 1),  # no GQA, one split
    (4, 1, 2, 120, 32, 16, torch.float32, 8),  # windowed (gemma3's local layers), 4 splits
    (8, 2, 1, 200, 80, 50, torch.bfloat16, 32),  # head_dim not a power of two, a window wider than a split
    (8, 1, 1, 1024, 64, None, torch.float32, 64),  # 64 splits: merged 16 at a time
    (4, 1, 2, 1024, 32, 40, torch.float32, 64),  # 64 splits, most of them outside the window: empty
]


def _slot_positions(slots, capacity, device):
    """One row at 0 (one key), one at the last position, the rest anywhere."""
    positions = torch.randint(0, capacity, (slots,), generator=_gen(41))
    positions[0], positions[-1] = 0, capacity - 1
    return positions.to(device)


@pytest.mark.parametrize("case", SLOT_DECODE_CASES, ids=lambda c: "H{}KV{}S{}L{}D{}w{}-{}-p{}".format(*c[:6], str(c[6])[6:], c[7]))
def test_slot_decode_attention_equals_the_reference(ops, device, monkeypatch, case):
    heads, kv_heads, slots, capacity, head_dim, window, dtype, programs = case
    monkeypatch.setattr(ops, "DECODE_PROGRAMS", programs)
    monkeypatch.setattr(ops, "DECODE_TILES", (16, *ops.DECODE_TILES[1:]))  # tiles of 16 keys: several a split
    positions = _slot_positions(slots, capacity, device)
    query = _randn(slots, heads, head_dim, dtype=dtype, device=device, seed=42).transpose(0, 1)
    # one layer of a pool [layers, slots, kv_heads, capacity, head_dim]: a view, as the graphs pass it
    keys = _randn(2, slots, kv_heads, capacity, head_dim, dtype=dtype, device=device, seed=43)[1]
    values = _randn(2, slots, kv_heads, capacity, head_dim, dtype=dtype, device=device, seed=44)[1]
    scale = head_dim**-0.5
    got = ops.slot_decode_attention(query, keys, values, positions, scale, window)
    want = torch_ref.slot_decode_attention(query, keys, values, positions, scale, window)
    _close(got, want, dtype)
    if programs > 1 and capacity > 64:
        assert ops.decode_splits(slots, kv_heads, capacity, 16) > 1


def test_slot_decode_attention_never_reads_past_a_rows_position(ops, device, monkeypatch):
    """The pool's padding past each slot's position (and before its window) is not read: NaN there changes
    nothing. The reference reads it (a masked NaN value still multiplies a zero probability)."""
    monkeypatch.setattr(ops, "DECODE_PROGRAMS", 16)
    monkeypatch.setattr(ops, "DECODE_TILES", (16, *ops.DECODE_TILES[1:]))
    heads, kv_heads, slots, capacity, head_dim = 4, 2, 3, 160, 32
    positions = torch.tensor([0, 70, 159], device=device)
    query = _randn(heads, slots, head_dim, dtype=torch.float32, device=device, seed=45)
    keys = _randn(slots, kv_heads, capacity, head_dim, dtype=torch.float32, device=device, seed=46)
    values = _randn(slots, kv_heads, capacity, head_dim, dtype=torch.float32, device=device, seed=47)
    for window in (None, 24):
        want = torch_ref.slot_decode_attention(query, keys, values, positions, 0.2, window)
        poisoned_k, poisoned_v = keys.clone(), values.clone()
        for slot, pos in enumerate(positions.tolist()):
            poisoned_k[slot, :, pos + 1 :] = poisoned_v[slot, :, pos + 1 :] = float("nan")
            if window is not None:  # whole tiles before the window are skipped too
                start = (pos - window + 1) // 16 * 16
                poisoned_k[slot, :, : max(start, 0)] = poisoned_v[slot, :, : max(start, 0)] = float("nan")
        got = ops.slot_decode_attention(query, poisoned_k, poisoned_v, positions, 0.2, window)
        _close(got, want, torch.float32)


def test_slot_kernels_take_positions_and_live_flags_as_strided_views(ops, device, monkeypatch):
    """The kernels index positions[slot] and live[slot] as if packed: a column of a wider table (a view with a
    stride of 2) was read at the wrong slots, where the reference reads any view."""
    monkeypatch.setattr(ops, "DECODE_TILES", (16, *ops.DECODE_TILES[1:]))
    heads, kv_heads, slots, capacity, head_dim = 4, 2, 3, 48, 32
    table = torch.stack([torch.tensor([5, 47, 20]), torch.tensor([1, 2, 3])], dim=1).to(device)  # [slots, 2]
    positions = table[:, 0]
    assert positions.stride(0) == 2
    query = _randn(heads, slots, head_dim, dtype=torch.float32, device=device, seed=52)
    keys = _randn(slots, kv_heads, capacity, head_dim, dtype=torch.float32, device=device, seed=53)
    values = _randn(slots, kv_heads, capacity, head_dim, dtype=torch.float32, device=device, seed=54)
    _close(ops.slot_decode_attention(query, keys, values, positions, 0.2, None),
           torch_ref.slot_decode_attention(query, keys, values, positions, 0.2, None), torch.float32)
    fresh = [_randn(kv_heads, slots, head_dim, dtype=torch.float32, device=device, seed=s) for s in (55, 56)]
    live = torch.tensor([[True, False], [False, True], [True, True]], device=device)[:, 0]
    pool, want = [keys.clone(), values.clone()], [keys.clone(), values.clone()]
    torch_ref.write_slot_rows(*want, *fresh, positions, live)
    ops.write_slot_rows(*pool, *fresh, positions, live)
    assert all(torch.equal(a, b) for a, b in zip(pool, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_slot_rows_writes_live_slots_only(ops, device, dtype):
    slots, kv_heads, capacity, head_dim = 4, 2, 20, 48
    pool = [_randn(slots, kv_heads, capacity, head_dim, dtype=dtype, device=device, seed=s) for s in (48, 49)]
    fresh = [_randn(kv_heads, slots, head_dim, dtype=torch.float32, device=device, seed=s) for s in (50, 51)]
    positions = torch.tensor([3, 0, 19, 7], device=device)
    live = torch.tensor([True, False, True, True], device=device)
    want = [t.clone() for t in pool]
    torch_ref.write_slot_rows(*want, *fresh, positions, live)
    ops.write_slot_rows(*pool, *fresh, positions, live)
    assert all(torch.equal(a, b) for a, b in zip(pool, want))
    assert torch.equal(pool[0][2, :, 19], fresh[0][:, 2].to(dtype))  # written, rounded to the pool's dtype
    assert not torch.equal(pool[0][1, :, 0], fresh[0][:, 1].to(dtype))  # slot 1 is not live: kept


# ------------------------------------------------------------------ kv_deviation


@pytest.mark.parametrize(
    "shape,dtype",
    [((3, 45, 64), torch.float32), ((1, 1, 128), torch.float32), ((4, 70, 128), torch.float16), ((2, 9, 256), torch.bfloat16)],
    ids=str,
)
def test_kv_deviation(ops, device, shape, dtype):
    fresh = _randn(*shape, dtype=dtype, device=device, seed=18)
    cached = (fresh.float() + 0.1 * _randn(*shape, dtype=torch.float32, device=device, seed=19)).to(dtype)
    cached[:, 0] = fresh[:, 0]  # one token without deviation
    got = ops.kv_deviation(fresh, cached)
    want = torch_ref.kv_deviation(fresh, cached)
    assert got.dtype == torch.float32 and got.shape == (shape[1],)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got[0] == 0


# ------------------------------------------------------------------ through the dispatcher


def test_dispatcher_runs_triton(ops, device, monkeypatch):
    monkeypatch.setattr(kernels, "_FORCED", "triton")
    assert kernels.backend_for(device) == "triton"
    assert kernels._impl(device) is ops

    layers, heads, head_dim = 2, 2, 64
    inv_freq, scaling = _rope_table(layers, 32, head_dim, seed=20)
    inv_freq, scaling = inv_freq.to(device), scaling.to(device)
    keys = _randn(layers, heads, 12, head_dim, dtype=torch.float32, device=device, seed=21)
    positions = torch.arange(12, device=device) - 4
    _close(kernels.rotate_keys(keys, positions, inv_freq, scaling), torch_ref.rotate_keys(keys, positions, inv_freq, scaling), torch.float32)

    chunks = [_randn(layers, heads, n, head_dim, dtype=torch.float32, device=device, seed=22 + n) for n in (5, 9)]
    joined = [torch.zeros(layers, heads, 16, head_dim, device=device) for _ in range(4)]
    kernels.place_chunks(joined[0], joined[1], chunks, chunks, [0, 6], inv_freq, scaling)
    torch_ref.place_chunks(joined[2], joined[3], chunks, chunks, [0, 6], inv_freq, scaling)
    _close(joined[0], joined[2], torch.float32)
    _close(joined[1], joined[3], torch.float32)

    query = _randn(4, 6, head_dim, dtype=torch.float32, device=device, seed=23)
    kv = joined[0][0], joined[1][0]
    rows = torch.tensor([0, 1, 6, 7, 14, 15], device=device)
    _close(kernels.selected_attention(query, *kv, rows, 0.125), torch_ref.selected_attention(query, *kv, rows, 0.125), torch.float32)
    _close(kernels.kv_deviation(kv[0], kv[1]), torch_ref.kv_deviation(kv[0], kv[1]), torch.float32)


# ------------------------------------------------------------------ batch-invariant Linear and RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_invariant_linear_equals_the_reference(ops, device, dtype, bias):
    weight = _randn(72, 100, dtype=dtype, device=device, seed=1)  # neither dimension a whole number of tiles
    b = _randn(72, dtype=dtype, device=device, seed=2) if bias else None
    x = _randn(2, 19, 100, dtype=dtype, device=device, seed=3)
    got = ops.invariant_linear(x, weight, b)
    assert got.shape == (2, 19, 72) and got.dtype == dtype
    _close(got, torch_ref.invariant_linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype),
           dtype)
    assert ops.invariant_linear(x[:, :0], weight, b).shape == (2, 0, 72)


def _row_among_others(op, row, others):
    """op(row) alone, and op's result for the row first, in the middle and last among counts of other rows up to
    len(others) (either side of a 16-row tile's edge)."""
    alone = op(row[None])[0]
    for count in (1, 2, 5, 15, 16, others.shape[0]):
        for at in {0, count // 2, count}:
            yield alone, op(torch.cat([others[:at], row[None], others[at:count]]))[at], (count, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_invariant_linear_gives_a_row_the_same_bits_at_any_count_and_place(ops, device, dtype):
    """Tiles fixed by the weight's shape: a row's reduction over K never depends on the row count or its place.
    In the interpreter the tile product is summed in order (numpy's BLAS behind tl.dot rounds by place), so this
    checks the kernel's tiling; `TRITON_INTERPRET=0 pytest tests/test_kernels.py` on a GPU checks it with MMA."""
    weight = _randn(72, 100, dtype=dtype, device=device, seed=4)
    b = _randn(72, dtype=dtype, device=device, seed=5)
    others = _randn(37, 100, dtype=dtype, device=device, seed=6)
    row = _randn(100, dtype=dtype, device=device, seed=7)
    for alone, among, where in _row_among_others(lambda x: ops.invariant_linear(x, weight, b), row, others):
        assert torch.equal(among, alone), where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("style", [(0.0, True), (1.0, False)], ids=["llama", "gemma3"])
def test_invariant_rms_norm_equals_the_reference_and_keeps_rows_apart(ops, device, dtype, style):
    weight = _randn(200, dtype=dtype, device=device, seed=8)
    x = _randn(3, 11, 200, dtype=dtype, device=device, seed=9)
    _close(ops.invariant_rms_norm(x, weight, 1e-6, *style), torch_ref.invariant_rms_norm(x, weight, 1e-6, *style),
           dtype)
    norm = lambda rows: ops.invariant_rms_norm(rows, weight, 1e-6, *style)  # noqa: E731
    for alone, among, where in _row_among_others(norm, x[0, 0], x.reshape(-1, 200)[1:21]):
        assert torch.equal(among, alone), where


_INVARIANT_MODEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from ragcache.engine.runner import Runner
    from tests import tiny

    for family in ("llama", "gemma3"):
        runner, plain = (Runner(tiny.make(family, dtype=torch.bfloat16), batch_invariant=flag)
                         for flag in (True, False))
        assert "Triton" in runner.invariance.how, runner.invariance
        # the request's ids 6:11, between others' (few rows: the interpreter runs a norm's program a row)
        ids = torch.cat([torch.arange(20, 26), torch.arange(3, 8), torch.arange(30, 36)])
        outs = []
        for r in (runner, plain):
            caches = [r.new_cache(64) for _ in range(3)]
            for cache in caches:
                cache.length = 40
            with torch.inference_mode():
                alone = r.forward(ids[6:11], [(caches[0], torch.arange(5))])
                packed = r.forward(ids, [(caches[1], torch.arange(5, 11)), (caches[2], torch.arange(5)),
                                         (caches[0], torch.arange(5, 11))])
            outs.append((alone, packed))
        (alone, packed), (plain_alone, _) = outs
        assert torch.equal(packed[:, 6:11], alone), family
        torch.testing.assert_close(alone, plain_alone, atol=0.05, rtol=0.05)
    print("invariant")
    """
)


def test_the_runner_takes_the_triton_kernels_where_the_kernels_are_triton():
    """The CUDA path, in the interpreter: RAGCACHE_KERNELS=triton makes a batch-invariant runner compute its Linears
    and RMSNorms (llama's rounding and gemma3's) with the fixed-tile kernels; a request's rows give the same bits
    alone and packed between others' rows, and agree with the library's own kernels to bf16 rounding."""
    env = dict(os.environ, TRITON_INTERPRET="1", RAGCACHE_KERNELS="triton")
    result = subprocess.run([sys.executable, "-c", _INVARIANT_MODEL_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and "invariant" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------ the GPU build (no GPU needed)

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ragcache.kernels import triton_ops as T

    SHARED = 227 * 1024  # a Hopper SM's shared memory a block may take: more fails at launch, not here

    def build(fn, pointers, consts, **options):
        sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                options=options)
        assert kernel.metadata.shared <= SHARED, (fn.__name__, consts, options, kernel.metadata.shared)
        return kernel

    rope = dict(HALF=64, HALF_P2=64, D=128, REST_P2=0)
    for dt, operand in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        f = dict(inv_freq="*fp32", scaling="*fp32")
        build(T._rotate_kernel, dict(f, src=f"*{dt}", dst=f"*{dt}", positions="*i64"), dict(rope, BLOCK_T=32),
              enable_fp_fusion=False)
        for stored, bits in ((dt, 0), ("u8", 8), ("u8", 4), ("u8", 2)):  # as computed, and codes decoded in the pass
            build(T._place_kernel, dict(f, joined_k=f"*{dt}", joined_v=f"*{dt}", meta="*i64", k_ref=f"*{stored}",
                  v_ref=f"*{stored}"), dict(rope, D_P2=128, BLOCK_T=32, NCOL=T._NCOL, BITS=bits),
                  enable_fp_fusion=False)
        # the tiles the kernels launch with on CUDA (attention_tiles), at head dims 64, 96 (a padded tail), 128 and
        # 256 (Gemma 3's); fp32's 96 shares 128's tiles and shared memory, and took a minute to build: its tail is bf16's
        for head_dim in (64, 96, 128, 256) if dt == "bf16" else (64, 128, 256):
            d_p2 = T._head_p2(head_dim)
            block_m, block_n, warps, stages = T.ATTENTION_TILES_FP32[d_p2] if dt == "fp32" else T.ATTENTION_TILES[d_p2]
            common = dict(QK_SCALE=0.18, GROUP=4, D=head_dim, D_P2=d_p2, BLOCK_M=block_m, BLOCK_N=block_n,
                          UPCAST=False, IEEE=dt == "fp32")
            for window in (False, True):
                build(T._attention_kernel, dict(q=f"*{dt}", k=f"*{dt}", v=f"*{dt}", query_positions="*i64",
                      out=f"*{dt}"), dict(common, HAS_WINDOW=window), num_warps=warps, num_stages=stages)
            build(T._slot_run_kernel, dict(q=f"*{dt}", k=f"*{dt}", v=f"*{dt}", slots="*i64", positions="*i64",
                  out=f"*{dt}"), dict(common, HAS_WINDOW=True), num_warps=warps, num_stages=stages)
            for splits, window in ((1, False), (1024, True)):
                build(T._slot_decode_kernel, dict(q=f"*{dt}", k=f"*{dt}", v=f"*{dt}", positions="*i64",
                      part_acc="*fp32", part_ml="*fp32"), dict(QK_SCALE=0.18, GROUP=4, HAS_WINDOW=window, D=head_dim,
                      D_P2=d_p2, BLOCK_M=16, BLOCK_N=T.DECODE_TILES[0], SPLITS=splits, UPCAST=False,
                      IEEE=dt == "fp32"), num_warps=T.DECODE_TILES[1], num_stages=T.DECODE_TILES[2])
                build(T._slot_combine_kernel, dict(part_acc="*fp32", part_ml="*fp32", out=f"*{dt}"),
                      dict(D=head_dim, D_P2=d_p2, SPLITS=splits, BLOCK_S=min(splits, 16)))
        build(T._deviation_kernel, dict(fresh=f"*{dt}", cached=f"*{dt}", out="*fp32"), dict(D=128, D_P2=128, BLOCK_T=32))
        build(T._write_slot_rows_kernel, dict(k=f"*{dt}", v=f"*{dt}", fresh_k=f"*{dt}", fresh_v=f"*{dt}",
              positions="*i64", live="*i1"), dict(D=128, D_P2=128))
        for out_features, in_features in ((1536, 576), (8960, 1536)):
            block_m, block_n, block_k, warps, stages = T._linear_tiles(out_features, in_features)
            for bias in (True, False):
                build(T._linear_kernel, dict(x=f"*{dt}", w=f"*{dt}", b=f"*{dt}", out=f"*{dt}"), dict(HAS_BIAS=bias,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SUM_DOT=False, IEEE=dt == "fp32"),
                      num_warps=warps, num_stages=stages)
        for cast_first, offset in ((True, 0.0), (False, 1.0)):
            build(T._rms_norm_kernel, dict(x=f"*{dt}", w=f"*{dt}", out=f"*{dt}"),
                  dict(EPS=1e-6, OFFSET=offset, CAST_FIRST=cast_first, BLOCK=4096))
    print("compiled")
    """
)


def test_kernels_compile_for_hopper():
    """The compiled (non-interpreted) path builds to sm_90 machine code with the tiles it launches with, each within
    an SM's shared memory; catches what the interpreter forgives (fp32 attention at head dim 128 took 384 KiB)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=800)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scored_attention_in_the_inputs_dtype_keeps_the_fp32_scores_order(dtype):
    """focus's pre-pass on CUDA runs its matmuls in the model's dtype (tensor cores, not fp32 GEMMs): its weights
    stay within the reduced dtype's tolerance of the fp32 pass, and the chunk rows it ranks highest are the same."""
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(8, 6, 32, generator=generator).to(dtype)
    keys, values = (torch.randn(2, 200, 32, generator=generator).to(dtype) for _ in range(2))
    positions = torch.arange(194, 200)
    out32, weights32 = torch_ref.scored_attention(query, keys, values, positions, 32 ** -0.5)
    out, weights = torch_ref.scored_attention(query, keys, values, positions, 32 ** -0.5, native_matmul=True)
    assert weights.dtype == torch.float32 and out.dtype == dtype
    torch.testing.assert_close(weights, weights32, atol=0.02 * float(weights32.max()), rtol=0)
    torch.testing.assert_close(out.float(), out32.float(), atol=0.05, rtol=0)
    top = set(torch.topk(weights32, 20).indices.tolist())
    assert len(top & set(torch.topk(weights, 20).indices.tolist())) >= 16


def test_a_contiguous_run_is_causal_from_the_bottom_right():
    """On CUDA a prefill piece at positions p..p+n-1 goes to SDPA with `causal_lower_right(n, p + n)` (FlashAttention
    takes it as is): that mask is exactly "row i sees keys up to p + i", the reference's causality at those rows."""
    from torch.nn.attention.bias import causal_lower_right

    generator = torch.Generator().manual_seed(4)
    query = torch.randn(1, 8, 5, 16, generator=generator)
    keys, values = (torch.randn(1, 2, 12, 16, generator=generator) for _ in range(2))
    got = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(5, 12),
                                                           scale=0.25, enable_gqa=True)
    expected = torch_ref.reference_attention(query[0], keys[0], values[0], torch.arange(7, 12), 0.25)
    torch.testing.assert_close(got[0].transpose(0, 1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_attention_gives_each_request_what_it_gets_alone(dtype):
    """Prefills from position 0 of several requests in one call (a compile's packed chunks): each request's rows
    are the very bits `selected_attention` gives it alone, GQA included, on this machine's SDPA."""
    batch, heads, kv_heads, rows, dim = 3, 4, 2, 37, 16
    query, keys, values = (
        _randn(batch, h, rows, dim, dtype=dtype, device="cpu", seed=seed)
        for h, seed in ((heads, 1), (kv_heads, 2), (kv_heads, 3))
    )
    joined = kernels.fresh_attention(query, keys, values, 0.25)
    assert joined.shape == (batch, rows, heads, dim)
    for b in range(batch):
        alone = torch_ref.selected_attention(
            query[b], keys[b], values[b], torch.arange(rows), 0.25, contiguous_from=0
        )
        assert torch.equal(joined[b], alone)


@pytest.mark.parametrize("window", [None, 3])
def test_slot_run_attention_gives_each_row_its_own_slots_attention(window):
    """A captured step's repair lanes: R rows of each of P lanes over their slots of a pool (lanes in any slot
    order, a slot left out), each row what `selected_attention` gives it over its slot's keys up to its position
    (GQA: 4 heads over 2)."""
    lanes, run, heads, kv_heads, length, dim = 3, 4, 4, 2, 20, 8
    keys, values = (_randn(5, kv_heads, length, dim, dtype=torch.float32, device="cpu", seed=s) for s in (1, 2))
    slots = torch.tensor([3, 0, 4])
    positions = torch.tensor([[3, 4, 5, 9], [10, 11, 12, 13], [0, 1, 2, 19]])
    query = _randn(heads, lanes * run, dim, dtype=torch.float32, device="cpu", seed=3)
    out = kernels.slot_run_attention(query, keys, values, slots, positions, 0.3, window)
    for lane, slot in enumerate(slots.tolist()):
        for j in range(run):
            row = lane * run + j
            alone = torch_ref.selected_attention(
                query[:, row : row + 1], keys[slot], values[slot], positions[lane, j : j + 1], 0.3, window
            )
            torch.testing.assert_close(out[row], alone[0], **TOL[torch.float32])


SLOT_RUN_CASES = [  # heads, kv_heads, pool slots, lanes, run, capacity, head_dim, window, dtype
    (4, 2, 5, 3, 4, 40, 16, None, torch.float32),
    (8, 2, 3, 2, 16, 150, 128, None, torch.bfloat16),  # llama3-8b's group of 4, capacity not a tile multiple
    (4, 1, 2, 2, 8, 120, 32, 16, torch.float32),  # windowed (gemma3's local layers)
    (9, 3, 4, 4, 2, 70, 64, None, torch.float16),  # smollm2's heads
]


@pytest.mark.parametrize("case", SLOT_RUN_CASES, ids=lambda c: "H{}KV{}S{}P{}R{}L{}D{}w{}-{}".format(*c[:8], str(c[8])[6:]))
def test_slot_run_attention_kernel_equals_the_reference(ops, device, case):
    """The Triton repair lanes read each lane's slot in place and only the tiles up to a block's last row: the
    reference's rows, and NaN past every row's position (and before its window) changes nothing."""
    heads, kv_heads, pool, lanes, run, capacity, head_dim, window, dtype = case
    generator = _gen(60)
    slots = torch.randperm(pool, generator=generator)[:lanes].to(device)
    starts = torch.randint(0, capacity - run, (lanes,), generator=generator)
    positions = (starts[:, None] + torch.arange(run)).to(device)  # a lane's rows are a run, as repair makes them
    query = _randn(heads, lanes * run, head_dim, dtype=dtype, device=device, seed=61)
    keys = _randn(2, pool, kv_heads, capacity, head_dim, dtype=dtype, device=device, seed=62)[1]  # a layer's view
    values = _randn(2, pool, kv_heads, capacity, head_dim, dtype=dtype, device=device, seed=63)[1]
    want = torch_ref.slot_run_attention(query, keys, values, slots, positions, head_dim**-0.5, window)
    _close(ops.slot_run_attention(query, keys, values, slots, positions, head_dim**-0.5, window), want, dtype)
    block_n = ops.attention_tiles(ops._p2(head_dim))[1]
    poisoned_k, poisoned_v = keys.clone(), values.clone()
    for lane, slot in enumerate(slots.tolist()):
        last, first = int(positions[lane, -1]), int(positions[lane, 0])
        poisoned_k[slot, :, last + 1 :] = poisoned_v[slot, :, last + 1 :] = float("nan")
        if window is not None:
            before = max(first - window + 1, 0) // block_n * block_n
            poisoned_k[slot, :, :before] = poisoned_v[slot, :, :before] = float("nan")
    unused = [s for s in range(pool) if s not in slots.tolist()]
    poisoned_k[unused] = poisoned_v[unused] = float("nan")
    got = ops.slot_run_attention(query, poisoned_k, poisoned_v, slots, positions, head_dim**-0.5, window)
    _close(got, want, dtype)


def test_write_slot_runs_writes_live_rows_and_leaves_the_rest():
    pool_keys, pool_values = torch.zeros(3, 2, 8, 4), torch.zeros(3, 2, 8, 4)
    fresh = torch.arange(1, 2 * 4 * 4 + 1, dtype=torch.float32).view(2, 4, 4)  # [KVH, P*R, D]: lanes 2 x rows 2
    slots, positions = torch.tensor([2, 0]), torch.tensor([[5, 6], [7, 3]])
    live = torch.tensor([[True, True], [True, False]])
    kernels.write_slot_runs(pool_keys, pool_values, fresh, -fresh, slots, positions, live)
    assert torch.equal(pool_keys[2, :, 5], fresh[:, 0]) and torch.equal(pool_keys[2, :, 6], fresh[:, 1])
    assert torch.equal(pool_keys[0, :, 7], fresh[:, 2]) and torch.equal(pool_values[0, :, 7], -fresh[:, 2])
    assert pool_keys.count_nonzero() == 3 * 2 * 4  # three live rows of 2 heads x 4; slot 1 untouched


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_aligned_attention_gives_a_row_the_same_bits_in_a_piece_cut_anywhere(backend, dtype, window, request):
    """A prompt's rows in one piece, in pieces cut at random places, and one row at a time: the same bits (what a
    repair that catches up needs to hold `full`'s cache exactly); and the plain definition's values within the
    dtype's rounding. GQA (3 query heads a key head: the Triton kernel's row tiles cut a row's heads apart unless
    placed at absolute positions); a sliding window on one side."""
    from ragcache.engine import invariant

    heads, kv_heads, rows, dim = 6, 2, 600, 16  # rows whose windows start in the second block of keys and later
    if backend == "torch":
        attend, device = torch_ref.aligned_attention, torch.device("cpu")
        if not invariant.cuts_alike(heads, kv_heads, dim, dtype, device, window):
            pytest.skip(f"{dtype}: " + NOT_CUT_INVARIANT)
    else:
        attend, device = request.getfixturevalue("ops").aligned_attention, request.getfixturevalue("device")
    query = _randn(heads, rows, dim, dtype=dtype, device=device, seed=5)
    keys, values = (_randn(kv_heads, rows, dim, dtype=dtype, device=device, seed=s) for s in (6, 7))
    whole = attend(query, keys, values, 0, 0.25, window)
    rng = random.Random(3)
    for _ in range(6 if backend == "torch" else 3):  # the interpreter runs a program at a time
        bounds = [0, *sorted(rng.sample(range(1, rows), rng.randint(1, 8))), rows]
        cut = [attend(query[:, a:b], keys, values, a, 0.25, window) for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(torch.cat(cut), whole), bounds
    for p in (0, 1, 15, 16, 17, 255, 256, 299, 550, 599):  # alone, at each edge of a tile and of a block of keys
        alone = attend(query[:, p : p + 1], keys, values, p, 0.25, window)
        assert torch.equal(alone, whole[p : p + 1])
    _close(whole, _reference(query, keys, values, torch.arange(rows, device=device), 0.25, window), dtype)
    with pytest.raises(ValueError, match="need keys up to 600"):
        attend(query, keys[:, :599], values, 0, 0.25)
