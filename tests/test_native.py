"""The tiled C kernel: the same product as torch, rows independent of their neighbours, and a clean fallback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine import native
from workers.engine.linear import Linear, linear

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler to build the tiled kernel")


@pytest.mark.parametrize("out_features, in_features", [(48, 32), (37, 19), (5, 1), (160, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11, 17])
def test_tiled_product_matches_torch(rows, out_features, in_features):
    """Odd input sizes, outputs that do not fill a tile, and more rows than one block holds."""
    torch.manual_seed(rows)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x, residual = torch.randn(rows, in_features), torch.randn(rows, out_features)
    tiled = native.tile(weight)
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(native.tiled_linear(x, tiled, out_features).double(), expected, rtol=1e-5, atol=1e-4)
    got = native.tiled_linear(x, tiled, out_features, bias, residual).double()
    torch.testing.assert_close(got, residual.double() + expected + bias.double(), rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: a row decoded alone or inside a verify block must round the same way."""
    torch.manual_seed(1)
    weight, x = torch.randn(96, 64), torch.randn(7, 64)
    tiled = native.tile(weight)
    together = native.tiled_linear(x, tiled, 96)
    for row in range(7):
        assert torch.equal(native.tiled_linear(x[row : row + 1], tiled, 96), together[row : row + 1])


def test_fp32_cpu_weights_get_the_tiled_layout_and_use_it_for_few_rows(monkeypatch):
    weight, x = torch.randn(48, 32), torch.randn(2, 3, 32)  # 6 rows: the tiled kernel
    weights = Linear.of(weight)
    if weights.packed is None:
        pytest.skip("no oneDNN in this torch build")
    assert weights.tiled is not None and weights.plain is None and weights.few_rows is weights.tiled
    calls = []
    monkeypatch.setattr(native, "tiled_linear", lambda *a, **k: calls.append(a) or F.linear(a[0], weight))
    linear(x, weights)
    linear(torch.randn(native.MAX_ROWS + 1, 32), weights)  # more rows than the kernel takes: oneDNN
    assert len(calls) == 1


def test_without_the_kernel_fp32_keeps_the_plain_gemv_layout(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    weights = Linear.of(torch.randn(48, 32))
    if weights.packed is None:
        pytest.skip("no oneDNN in this torch build")
    assert weights.tiled is None and weights.plain is not None


def test_switched_off_or_without_a_compiler_the_kernel_is_unavailable(monkeypatch):
    native._library.cache_clear()
    try:
        monkeypatch.setenv("SPECBATCH_NATIVE", "0")
        assert not native.available()
        monkeypatch.setenv("SPECBATCH_NATIVE", "1")
        monkeypatch.setenv("CC", "no-such-compiler")
        assert not native.available()
    finally:
        native._library.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_norm_and_the_gate_inside_the_kernel_match_torch(rows):
    """f(x) before the product: transformers' RMS norm, or silu(gate) * up, within fp32 rounding of torch's."""
    torch.manual_seed(rows)
    weight, norm, x = torch.randn(40, 24), torch.randn(24), torch.randn(rows, 24)
    tiled = native.tile(weight)
    normed = torch.rms_norm(x, (24,), norm, 1e-5)
    torch.testing.assert_close(native.tiled_linear(x, tiled, 40, norm=norm, eps=1e-5), normed @ weight.t(),
                               rtol=1e-5, atol=1e-5)
    gate_up, residual = torch.randn(rows, 48), torch.randn(rows, 40)
    gated = F.silu(gate_up[:, :24]) * gate_up[:, 24:]
    torch.testing.assert_close(native.tiled_linear(gate_up, tiled, 40, residual=residual, gated=True),
                               residual + gated @ weight.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="input of 24 features for a weight of 24 \\(gated\\)"):
        native.tiled_linear(x, tiled, 40, gated=True)


def test_decode_attention_matches_torch_rotary_cache_write_and_causal_sdpa():
    """Rows of different lengths, several new tokens each, grouped-query heads: the cache afterwards and the
    output equal what the torch path computes (rotate_half rotary, scatter, SDPA under the causal mask)."""
    from transformers.models.llama.modeling_llama import rotate_half

    torch.manual_seed(3)
    n, q, heads, kv_heads, d, slots, capacity, first = 2, 3, 4, 2, 32, 4, 20, 1
    lengths = torch.tensor([5, 9])
    positions = lengths[:, None] + torch.arange(q)
    qkv = torch.randn(n, q, (heads + 2 * kv_heads) * d)
    cos, sin = torch.randn(n, q, d), torch.randn(n, q, d)
    keys, values = torch.randn(slots, kv_heads, capacity, d), torch.randn(slots, kv_heads, capacity, d)
    want_keys, want_values = keys.clone(), values.clone()

    split = qkv.view(n, q, heads + 2 * kv_heads, d)
    rotated = split * cos[:, :, None] + rotate_half(split) * sin[:, :, None]
    query = rotated[:, :, :heads].transpose(1, 2)
    where = positions[:, None, :, None].expand(n, kv_heads, q, d)
    want_keys[first : first + n].scatter_(2, where, rotated[:, :, heads : heads + kv_heads].transpose(1, 2))
    want_values[first : first + n].scatter_(2, where, split[:, :, heads + kv_heads :].transpose(1, 2))
    visible = torch.arange(capacity) <= positions[..., None]
    mask = torch.zeros(n, 1, q, capacity).masked_fill_(~visible[:, None], float("-inf"))
    want = F.scaled_dot_product_attention(query, want_keys[first : first + n], want_values[first : first + n],
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2)

    got = native.decode_attention(qkv, cos, sin, positions, keys, values, first, heads, kv_heads)
    torch.testing.assert_close(keys, want_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, want_values)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_querys_attention_does_not_depend_on_the_rows_or_tokens_beside_it():
    """Bit for bit: a row's first new token attends the same alone as inside a batch of rows and a verify block
    (the cache it sees is the same: later tokens' keys sit past its position)."""
    torch.manual_seed(4)
    n, q, heads, kv_heads, d, capacity = 3, 2, 6, 2, 64, 40
    positions = torch.tensor([7, 30, 18])[:, None] + torch.arange(q)
    qkv, cos, sin = torch.randn(n, q, (heads + 2 * kv_heads) * d), torch.randn(n, q, d), torch.randn(n, q, d)
    keys, values = torch.randn(n, kv_heads, capacity, d), torch.randn(n, kv_heads, capacity, d)
    together = native.decode_attention(qkv, cos, sin, positions, keys.clone(), values.clone(), 0, heads, kv_heads)
    for row in range(n):
        one = slice(row, row + 1)
        alone = native.decode_attention(qkv[one, :1], cos[one, :1], sin[one, :1], positions[one, :1], keys.clone(),
                                        values.clone(), row, heads, kv_heads)
        assert torch.equal(alone[0, 0], together[row, 0])


@pytest.mark.parametrize("line, isa", [("flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw", "AVX-512"),
                                       ("flags\t\t: fpu sse2 avx avx2 fma", "AVX2"),
                                       ("Features\t: fp asimd evtstrm aes", "NEON"),
                                       ("flags\t\t: fpu sse sse2", "SSE2")])
def test_the_vector_isa_is_read_from_the_cpu_flags(monkeypatch, line, isa):
    """The widest ISA names the kernels' vector width: bench reports say which the numbers were measured with."""
    monkeypatch.setattr(native, "cpuinfo", lambda: ["model name\t: Some CPU", line])
    assert native.vector_isa() == isa
    assert native.cpu_name() == "Some CPU"


def test_the_kernel_build_id_follows_the_cpu_features(monkeypatch):
    """Remembered kernel choices and compiled kernels are keyed by the CPU's features, not only its name: KVM guests
    of different generations share a name like 'AMD EPYC'."""
    if native.build_id() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(native, "cpuinfo", lambda: ["model name\t: AMD EPYC", "flags\t\t: avx2 fma"])
    avx2 = native.build_id(), native.cpu_id()
    monkeypatch.setattr(native, "cpuinfo", lambda: ["model name\t: AMD EPYC", "flags\t\t: avx2 fma avx512f"])
    assert native.build_id() != avx2[0] and native.cpu_id() != avx2[1]
