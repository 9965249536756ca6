"""Linear layers: siblings fused into one product; the CPU's attention
product (`product_nt`) equal to x @ w.T for any strides; the cpu backend's
oneDNN Linear (backends/cpu/linear.py: packed weights replace the dense
ones; a weight shared with an embedding keeps its dense copy beside the
packed one, or only the dense one where memory is short) equal to
F.linear."""

import pytest
import torch
from torch import nn

from hybridkv.layers import linear
from hybridkv.layers.backends import PrepareReport
from hybridkv.layers.backends.cpu import linear as cpu_linear
from hybridkv.layers.linear import Linear


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.up = Linear(16, 40, bias=True)
        self.head = Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as Gemma's LM head


# bfloat16: both sides see the same bfloat16 operands; the sums' order and
# where the output is rounded differ (an ulp of 2^-8 at values near 1-4).
CLOSE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spare", [1 << 40, 0])
def test_packed_onednn_linears_agree_with_f_linear(spare, dtype, monkeypatch):
    if linear._onednn_ops() is None:
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(cpu_linear, "spare_memory", lambda: spare)
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    x = torch.randn(7, 16).to(dtype)
    expected = (nn.functional.linear(x.float(), model.up.weight.float(), model.up.bias.float()),
                nn.functional.linear(x.float(), model.embed.weight.float()))
    report = PrepareReport("cpu")
    cpu_linear.pack_linears(model, report)
    assert isinstance(model.up, cpu_linear.OneDNNLinear) and isinstance(model.head, cpu_linear.OneDNNLinear)
    assert model.up.weight.numel() == 0 and model.up.packed is not None  # dense copy dropped
    assert model.head.weight is model.embed.weight  # the embedding's rows stay readable
    assert (model.head.packed is not None) == bool(spare)  # a packed copy beside them where memory allows
    assert bool(report.declined) == (not spare)  # and the report says when it is not
    got = (model.up(x), model.head(x), model.embed(torch.tensor([3])))
    for g, e in zip(got, (*expected, model.embed.weight[3:4].float())):
        assert g.dtype == dtype and torch.allclose(g.float(), e, **CLOSE[dtype])
    assert model.up(x[None]).shape == (1, 7, 40)  # leading dimensions kept


def test_other_dtypes_and_devices_have_no_onednn_product():
    assert linear.onednn_ops(torch.device("cpu"), torch.float16) is None
    assert linear.onednn_ops(torch.device("meta"), torch.float32) is None
    model = Tiny().to(torch.float16)
    report = PrepareReport("cpu")
    cpu_linear.pack_linears(model, report)
    assert type(model.up) is Linear and model.up.weight.numel() == 40 * 16
    assert "F.linear runs" in report.declined[0]


def test_fused_linear_is_the_parts_side_by_side():
    torch.manual_seed(1)
    parts = [Linear(8, n, bias=True) for n in (3, 5, 2)]
    fused = Linear.fused(parts)
    x = torch.randn(4, 8)
    assert torch.allclose(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_product_nt_is_x_times_w_transposed_for_any_strides():
    # Attention's products on the CPU (the reference's prefill tiles): a
    # transposed (strided) right operand, as the value rows are passed.
    # Small products go to torch.mm, big ones (ONEDNN_MIN_PRODUCT) to oneDNN.
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((9, 24, 13), (256, 256, 130)):
        x, w, wt = (torch.randn(*shape, generator=gen) for shape in ((m, k), (n, k), (k, n)))
        torch.testing.assert_close(linear.product_nt(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(linear.product_nt(x, wt.t()), x @ wt, rtol=1e-4, atol=1e-4)
