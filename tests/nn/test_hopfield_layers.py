"""attnkit.nn.Hopfield, HopfieldPooling, HopfieldLayer against an explicit float64 computation."""
import math

import pytest
import torch

import attnkit
from attnkit.nn.hopfield import Hopfield, HopfieldLayer, HopfieldPooling

# -- explicit float64 ground truth: per batch item, per head, per row, no attnkit op ----------------


def _ln(x, norm):
    """LayerNorm over the last dim written out (biased variance)."""
    if norm is None:
        return x
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + norm.eps)
    if norm.weight is not None:
        y = y * norm.weight.double() + (norm.bias.double() if norm.bias is not None else 0)
    return y


def _lin(x, lin):
    if lin is None:
        return x
    y = x @ lin.weight.double().t()
    return y + lin.bias.double() if lin.bias is not None else y


def _explicit(layer: Hopfield, stored, state, proj, padding=None, association=None):
    """[B, N, Fs], [B, S, F], [B, N, Fp] (batch first, float64) -> [B, S, output_size]."""
    stored, state, proj = stored.double(), state.double(), proj.double()
    b, s, n = state.shape[0], state.shape[1], stored.shape[1]
    h, hd, pd = layer.num_heads, layer.hidden_size, layer.pattern_size
    q_all = _lin(_ln(state, layer.norm_state_pattern), layer.state_projection)
    k_all = _lin(_ln(stored, layer.norm_stored_pattern), layer.stored_projection)
    v_all = _lin(_ln(proj, layer.norm_pattern_projection), layer.pattern_projection_layer)
    beta, tol = layer.scaling, layer.update_steps_eps
    out = torch.zeros(b, s, h * pd, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            k = k_all[bi, :, hi * hd:(hi + 1) * hd]
            v = v_all[bi, :, hi * pd:(hi + 1) * pd]
            bias = torch.zeros(s, n, dtype=torch.float64)
            if association is not None:
                a = association if association.dim() == 2 else association[bi * h + hi]
                bias = bias + (torch.where(a, -math.inf, 0.0) if a.dtype == torch.bool else a.double())
            if padding is not None:
                bias = bias + torch.where(padding[bi], -math.inf, 0.0).unsqueeze(0)
            extra_k, extra_v = [], []
            if layer.bias_stored is not None:
                extra_k.append(layer.bias_stored[hi].double())
                extra_v.append(layer.bias_projection[hi].double())
            if layer.add_zero_association:
                extra_k.append(torch.zeros(1, hd, dtype=torch.float64))
                extra_v.append(torch.zeros(1, pd, dtype=torch.float64))
            k = torch.cat([k] + extra_k)
            v = torch.cat([v] + extra_v)
            bias = torch.cat([bias, torch.zeros(s, len(extra_k), dtype=torch.float64)], dim=1)
            for si in range(s):
                xi = q_all[bi, si, hi * hd:(hi + 1) * hd]
                row_bias = bias[si]

                def probs(x):
                    sc = beta * (k @ x) + row_bias
                    if torch.isinf(sc).all():
                        return torch.zeros_like(sc)
                    e = torch.exp(sc - sc.max())
                    return e / e.sum()

                for _ in range(layer.update_steps_max):
                    new = probs(xi) @ k
                    done = (new - xi).abs().max() <= tol
                    xi = new
                    if done:  # this row keeps the update and is frozen
                        break
                out[bi, si, hi * pd:(hi + 1) * pd] = probs(xi) @ v
    return _lin(out, layer.out_projection)


def _rand_like_params(layer, seed=0):
    """Non-trivial LayerNorm affine parameters, biases (the defaults are ones / zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    return layer


def _inputs(b, n, s, fs, f, fp, dtype=torch.float64):
    return (torch.randn(b, n, fs, dtype=dtype), torch.randn(b, s, f, dtype=dtype), torch.randn(b, n, fp, dtype=dtype))


CONFIGS = [
    dict(input_size=9, num_heads=1, hidden_size=5, pattern_size=7, output_size=6,
         stored_pattern_size=11, pattern_projection_size=4),
    dict(input_size=12, num_heads=3),
    dict(input_size=8, num_heads=2, hidden_size=3, concat_bias_pattern=True, add_zero_association=True,
         normalize_state_pattern_affine=False, input_bias=False),
    dict(input_size=8, num_heads=2, hidden_size=4, pattern_size=3, stored_pattern_as_static=True,
         state_pattern_as_static=True, pattern_projection_size=6, pattern_projection_as_static=True,
         normalize_stored_pattern=False, disable_out_projection=True),
]


@pytest.mark.parametrize("steps", [0, 1, 4])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["sizes", "heads", "bias_zero", "static"])
def test_matches_explicit_float64(cfg, steps):
    layer = _rand_like_params(Hopfield(**cfg, update_steps_max=steps, update_steps_eps=0.0).double())
    sizes = (layer.stored_pattern_dim, layer.state_pattern_dim, layer.pattern_projection_dim)
    stored, state, proj = _inputs(2, 7, 5, *sizes)
    got = layer((stored, state, proj))
    want = _explicit(layer, stored, state, proj)
    assert got.shape == (2, 5, layer.output_size)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_float32_within_tolerance_and_several_steps_differ():
    layer = _rand_like_params(Hopfield(input_size=16, num_heads=2, update_steps_max=3, update_steps_eps=0.0,
                                       scaling=0.7))
    x = torch.randn(3, 63, 16)
    got = layer(x)
    want = _explicit(layer, x, x, x)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    layer.update_steps_max = 0
    assert (layer(x) - got).abs().max() > 1e-3  # the extra steps change the result


def test_early_stop_rule():
    """update_steps_eps freezes a row whose change is <= eps (hopfield_update's tol rule), both on
    the fused path and on the masked path."""
    torch.manual_seed(3)
    layer = Hopfield(input_size=8, num_heads=2, update_steps_max=6, update_steps_eps=0.05,
                     normalize_state_pattern=False, normalize_stored_pattern=False).double()
    stored, state, proj = _inputs(2, 9, 7, 8, 8, 8)
    got = layer((stored, state, proj))
    torch.testing.assert_close(got, _explicit(layer, stored, state, proj), rtol=1e-10, atol=1e-10)
    no_pad = torch.zeros(2, 9, dtype=torch.bool)  # an all-visible mask takes the masked path
    torch.testing.assert_close(layer((stored, state, proj), stored_pattern_padding_mask=no_pad), got,
                               rtol=1e-10, atol=1e-10)
    layer.update_steps_eps = 0.0
    assert (layer((stored, state, proj)) - got).abs().max() > 1e-8  # the freeze did change something


@pytest.mark.parametrize("batch_first", [True, False])
def test_shapes_batch_first(batch_first):
    layer = Hopfield(input_size=10, hidden_size=3, num_heads=2, output_size=5, pattern_size=4,
                     stored_pattern_size=6, pattern_projection_size=7, batch_first=batch_first,
                     update_steps_max=1)
    stored, state, proj = torch.randn(3, 11, 6), torch.randn(3, 4, 10), torch.randn(3, 11, 7)
    if batch_first:
        out = layer((stored, state, proj))
        assert out.shape == (3, 4, 5)
    else:
        out = layer((stored.transpose(0, 1), state.transpose(0, 1), proj.transpose(0, 1)))
        assert out.shape == (4, 3, 5)
        layer.batch_first = True
        torch.testing.assert_close(out, layer((stored, state, proj)).transpose(0, 1))
    single = Hopfield(input_size=10, batch_first=batch_first)
    assert single(torch.randn(3, 4, 10)).shape == (3, 4, 10)


def test_noncontiguous_and_empty():
    layer = Hopfield(input_size=6, num_heads=2, update_steps_max=1)
    x = torch.randn(6, 5, 3).permute(2, 1, 0)  # [3, 5, 6], non-contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()))
    stored = torch.randn(3, 5, 6)
    assert layer((stored, torch.randn(3, 0, 6), stored)).shape == (3, 0, 6)
    # No stored pattern: a zero retrieval, so the output is the output projection's bias.
    empty = torch.randn(3, 0, 6)
    out = layer((empty, torch.randn(3, 4, 6), empty))
    torch.testing.assert_close(out, layer.out_projection.bias.expand(3, 4, 6))


def test_masks_match_explicit():
    layer = _rand_like_params(Hopfield(input_size=8, num_heads=2, update_steps_max=2, update_steps_eps=0.0,
                                       concat_bias_pattern=True).double())
    b, n, s = 2, 7, 5
    stored, state, proj = _inputs(b, n, s, 8, 8, 8)
    pad = torch.zeros(b, n, dtype=torch.bool)
    pad[0, 4:] = True
    pad[1, :2] = True
    assoc2 = torch.rand(s, n) < 0.3
    assoc3 = torch.rand(b * 2, s, n) < 0.3
    assoc_f = torch.randn(s, n, dtype=torch.float64)
    for kw in (dict(padding=pad), dict(association=assoc2), dict(association=assoc3),
               dict(association=assoc_f), dict(padding=pad, association=assoc3), dict(padding=pad, association=assoc_f)):
        got = layer((stored, state, proj), stored_pattern_padding_mask=kw.get("padding"),
                    association_mask=kw.get("association"))
        torch.testing.assert_close(got, _explicit(layer, stored, state, proj, **kw), rtol=1e-10, atol=1e-10)
    # Masked-out stored patterns have no influence at all.
    stored2, proj2 = stored.clone(), proj.clone()
    stored2[0, 4:] = 100.0
    proj2[0, 4:] = -100.0
    a = layer((stored, state, proj), stored_pattern_padding_mask=pad)
    c = layer((stored2, state, proj2), stored_pattern_padding_mask=pad)
    torch.testing.assert_close(a[0], c[0])


def test_fully_masked_row_gives_zero_retrieval():
    layer = Hopfield(input_size=4, num_heads=1, update_steps_max=1).double()
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    assoc = torch.zeros(3, 3, dtype=torch.bool)
    assoc[1] = True  # row 1 may associate with nothing
    out = layer(x, association_mask=assoc)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 1], layer.out_projection.bias)


def test_gradients_flow_to_everything():
    layer = Hopfield(input_size=6, num_heads=2, update_steps_max=2, concat_bias_pattern=True,
                     stored_pattern_size=5, pattern_projection_size=4)
    stored, state, proj = (t.requires_grad_() for t in _inputs(2, 7, 3, 5, 6, 4, dtype=torch.float32))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 0] = True
    for mask in (None, pad):
        layer.zero_grad()
        for t in (stored, state, proj):
            t.grad = None
        layer((stored, state, proj), stored_pattern_padding_mask=mask).square().sum().backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        for t in (stored, state, proj):
            assert t.grad is not None and t.grad.abs().sum() > 0


def test_gradcheck_float64():
    layer = Hopfield(input_size=4, num_heads=2, update_steps_max=2, update_steps_eps=0.0).double()
    stored, state, proj = (t.requires_grad_() for t in _inputs(1, 3, 2, 4, 4, 4))
    assert torch.autograd.gradcheck(lambda a, b, c: layer((a, b, c)), (stored, state, proj))
    pad = torch.tensor([[False, True, False]])
    assert torch.autograd.gradcheck(lambda a, b, c: layer((a, b, c), stored_pattern_padding_mask=pad),
                                    (stored, state, proj))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = Hopfield(input_size=8, num_heads=2, dropout=0.5, update_steps_max=1)
    ref = Hopfield(input_size=8, num_heads=2, update_steps_max=1)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 8)
    layer.eval()
    torch.testing.assert_close(layer(x), ref(x))
    layer.train()
    assert (layer(x) - ref(x)).abs().max() > 1e-3


def test_default_scaling_and_sizes():
    layer = Hopfield(input_size=12, num_heads=3)
    assert layer.hidden_size == 4 and layer.pattern_size == 4 and layer.output_size == 12
    assert layer.scaling == pytest.approx(0.5)
    assert Hopfield(input_size=12, hidden_size=9).scaling == pytest.approx(1 / 3)
    assert Hopfield(input_size=12, num_heads=3, pattern_size=5, disable_out_projection=True).output_size == 15


def test_retrieval_demo():
    """Stored random ±1 patterns; a query with 10% of its bits flipped is retrieved in one step."""
    d, n = 64, 100
    patterns = torch.randint(0, 2, (1, n, d)).float() * 2 - 1
    layer = Hopfield(input_size=d, scaling=1.0, stored_pattern_as_static=True, state_pattern_as_static=True,
                     pattern_projection_as_static=True, normalize_stored_pattern=False,
                     normalize_state_pattern=False, normalize_pattern_projection=False,
                     disable_out_projection=True)
    assert len(list(layer.parameters())) == 0
    queries = patterns[:, :20] * torch.where(torch.rand(1, 20, d) < 0.1, -1.0, 1.0)
    out = layer((patterns, queries, patterns))
    assert torch.equal(out.sign(), patterns[:, :20])
    torch.testing.assert_close(out, patterns[:, :20], atol=1e-3, rtol=0)


def test_not_implemented_and_validation():
    for kw in (dict(normalize_hopfield_space=True), dict(pattern_projection_as_connected=True),
               dict(association_activation="relu"), dict(update_steps_max=-1),
               dict(scaling=torch.tensor([1.0]))):
        with pytest.raises(NotImplementedError, match="not supported"):
            Hopfield(input_size=4, **kw)
    with pytest.raises(ValueError, match="input_size is required"):
        Hopfield()
    with pytest.raises(ValueError, match="num_heads must divide input_size"):
        Hopfield(input_size=5, num_heads=2)
    with pytest.raises(ValueError, match="scaling must be a finite real > 0"):
        Hopfield(input_size=4, scaling=0.0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        Hopfield(input_size=4, dropout=1.0)
    with pytest.raises(ValueError, match="update_steps_eps must be a finite real >= 0"):
        Hopfield(input_size=4, update_steps_eps=-1.0)
    with pytest.raises(TypeError, match="update_steps_max must be an int"):
        Hopfield(input_size=4, update_steps_max=1.5)
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        Hopfield(input_size=4, num_heads=0)
    with pytest.raises(ValueError, match="static stored pattern is used without projection"):
        Hopfield(input_size=4, hidden_size=3, stored_pattern_as_static=True)
    with pytest.raises(ValueError, match="concat_bias_pattern cannot be combined"):
        Hopfield(input_size=4, stored_pattern_as_static=True, concat_bias_pattern=True)
    layer = Hopfield(input_size=4)
    x = torch.randn(2, 3, 4)
    with pytest.raises(TypeError, match="input must be a tensor or a tuple"):
        layer((x, x))
    with pytest.raises(ValueError, match="state_pattern must have 4 features"):
        layer((x, torch.randn(2, 3, 5), x))
    with pytest.raises(ValueError, match="must be 3-D"):
        layer(x[0])
    with pytest.raises(ValueError, match="same batch size"):
        layer((x, torch.randn(1, 3, 4), x))
    with pytest.raises(ValueError, match="same number of patterns"):
        layer((x, x, torch.randn(2, 5, 4)))
    with pytest.raises(ValueError, match=r"stored_pattern_padding_mask must be \[B, N\]"):
        layer(x, stored_pattern_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="stored_pattern_padding_mask must be bool"):
        layer(x, stored_pattern_padding_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"association_mask must be \[S, N\]"):
        layer(x, association_mask=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="association_mask must be bool"):
        layer(x, association_mask=torch.zeros(3, 3, dtype=torch.long))


# -- HopfieldPooling -------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
def test_pooling_semantics(batch_first):
    pool = HopfieldPooling(input_size=6, num_heads=2, quantity=3, output_size=5, update_steps_max=1,
                           batch_first=batch_first).double()
    x = torch.randn(4, 9, 6, dtype=torch.float64)
    out = pool(x if batch_first else x.transpose(0, 1))
    assert out.shape == (4, 15)
    hf = pool.hopfield
    state = pool.pooling_weights.unsqueeze(0).expand(4, -1, -1)
    want = _explicit(hf, x, state, x)  # [4, quantity, 5]
    torch.testing.assert_close(out, want.reshape(4, 15), rtol=1e-10, atol=1e-10)
    # Pooling is order-invariant over the stored patterns (a set operation).
    perm = torch.randperm(9)
    xp = x[:, perm]
    torch.testing.assert_close(pool(xp if batch_first else xp.transpose(0, 1)), out, rtol=1e-10, atol=1e-10)


def test_pooling_padding_grads_and_trainable():
    pool = HopfieldPooling(input_size=6, quantity=2)
    x = torch.randn(3, 8, 6)
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[:, 5:] = True
    torch.testing.assert_close(pool(x, stored_pattern_padding_mask=pad), pool(x[:, :5]))
    pool(x).sum().backward()
    assert pool.pooling_weights.grad is not None and pool.pooling_weights.grad.abs().sum() > 0
    assert not HopfieldPooling(input_size=6, trainable=False).pooling_weights.requires_grad
    assert HopfieldPooling(input_size=6, hidden_size=3, num_heads=2,
                           state_pattern_as_static=True).pooling_weights.shape == (1, 6)
    with pytest.raises(ValueError, match="quantity must be >= 1"):
        HopfieldPooling(input_size=6, quantity=0)


# -- HopfieldLayer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("separated", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_lookup_semantics(separated, batch_first):
    lookup = HopfieldLayer(input_size=6, num_heads=2, quantity=11, update_steps_max=2, update_steps_eps=0.0,
                           lookup_weights_as_separated=separated, batch_first=batch_first,
                           pattern_projection_size=5 if separated else None).double()
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    out = lookup(x if batch_first else x.transpose(0, 1))
    if not batch_first:
        out = out.transpose(0, 1)
    assert out.shape == (3, 4, 6)
    stored = lookup.lookup_weights.unsqueeze(0).expand(3, -1, -1)
    targets = stored if not separated else lookup.target_weights.unsqueeze(0).expand(3, -1, -1)
    torch.testing.assert_close(out, _explicit(lookup.hopfield, stored, x, targets), rtol=1e-10, atol=1e-10)
    # Each state retrieves on its own: the result for one row does not depend on the others.
    torch.testing.assert_close(lookup(x[1:2] if batch_first else x[1:2].transpose(0, 1)),
                               (out[1:2] if batch_first else out[1:2].transpose(0, 1)), rtol=1e-10, atol=1e-10)


def test_lookup_params_and_grads():
    lookup = HopfieldLayer(input_size=6, quantity=7, lookup_weights_as_separated=True)
    assert lookup.lookup_weights.shape == (7, 6) and lookup.target_weights.shape == (7, 6)
    lookup(torch.randn(2, 3, 6)).sum().backward()
    assert lookup.lookup_weights.grad.abs().sum() > 0 and lookup.target_weights.grad.abs().sum() > 0
    frozen = HopfieldLayer(input_size=6, quantity=7, lookup_weights_as_separated=True,
                           lookup_targets_as_trainable=False, trainable=False)
    assert not frozen.target_weights.requires_grad and not frozen.lookup_weights.requires_grad
    assert HopfieldLayer(input_size=6).target_weights is None
    with pytest.raises(ValueError, match="stored_pattern_size and pattern_projection_size must agree"):
        HopfieldLayer(input_size=6, pattern_projection_size=5)
    # The padding mask runs over the learned stored patterns.
    lookup = HopfieldLayer(input_size=6, quantity=5)
    pad = torch.tensor([[False, False, True, True, True]]).expand(2, -1)
    x = torch.randn(2, 3, 6)
    assert lookup(x, stored_pattern_padding_mask=pad).shape == (2, 3, 6)


def test_lookup_retrieval_with_static_memory():
    """A HopfieldLayer whose lookup weights are a set of ±1 patterns acts as an associative memory."""
    d, n = 32, 40
    lookup = HopfieldLayer(input_size=d, quantity=n, scaling=1.0, stored_pattern_as_static=True,
                           state_pattern_as_static=True, pattern_projection_as_static=True,
                           normalize_stored_pattern=False, normalize_state_pattern=False,
                           normalize_pattern_projection=False, disable_out_projection=True, trainable=False)
    with torch.no_grad():
        lookup.lookup_weights.copy_(torch.randint(0, 2, (n, d)).float() * 2 - 1)
    q = lookup.lookup_weights[:10].unsqueeze(0) * torch.where(torch.rand(1, 10, d) < 0.1, -1.0, 1.0)
    assert torch.equal(lookup(q).sign(), lookup.lookup_weights[:10].unsqueeze(0))


def test_public_function_is_what_runs(monkeypatch):
    """Without masks and dropout the layer makes exactly one attnkit.hopfield_update call."""
    import attnkit.nn.hopfield as mod

    calls = []
    real = mod.hopfield_update

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "hopfield_update", spy)
    layer = Hopfield(input_size=8, num_heads=2, update_steps_max=3, update_steps_eps=1e-3, scaling=0.25)
    layer(torch.randn(2, 5, 8))
    assert len(calls) == 1
    assert calls[0]["steps"] == 4 and calls[0]["beta"] == 0.25 and calls[0]["tol"] == 1e-3
    assert calls[0]["values"] is not None
    assert attnkit.hopfield_update is real


def test_torch_compile_fullgraph():
    layer = Hopfield(input_size=8, num_heads=2, update_steps_max=2)
    x = torch.randn(2, 5, 8)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=2e-5, atol=2e-5)
