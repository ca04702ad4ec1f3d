"""The torch estimator (meta-device simulation) on a tiny module whose numbers can be worked out."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from distmem.errors import ConfigError  # noqa: E402
from distmem.estimate import estimate_torch  # noqa: E402
from distmem.estimate.optimizers import torch_optimizer  # noqa: E402


def tiny():
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def by_kind(est):
    return [(r.name, r.kind) for r in est.layers]


def test_tiny_module_table():
    model = tiny()
    est = estimate_torch(model, input_shape=(4,), batch_size=5, optimizer="sgd", device="cpu")
    assert by_kind(est) == [("0", "Linear"), ("1", "ReLU"), ("2", "Linear")]
    lin0, relu, lin2 = est.layers
    assert (lin0.params, lin2.params) == (4 * 3 + 3, 3 * 2 + 2)
    assert lin0.param_bytes == lin0.grad_bytes == 15 * 4
    assert lin0.optimizer_bytes == 0  # torch's SGD without momentum keeps no state
    # Linear(0) keeps only its input (the caller's batch); ReLU keeps its output, which Linear(2) reads as
    # well; Linear(2)'s output is alive for the loss when the backward pass starts
    assert lin0.activation_bytes_per_sample == 0
    assert relu.activation_bytes_per_sample == 3 * 4
    assert lin2.activation_bytes_per_sample == 2 * 4
    assert relu.output_bytes_per_sample == 3 * 4
    assert est.method == "simulated"
    # the user's module is untouched: still on CPU, real weights
    assert next(model.parameters()).device.type == "cpu"


def test_adam_state_and_peak_bounds():
    est = estimate_torch(tiny(), input_shape=(4,), batch_size=5, optimizer=torch.optim.Adam, device="cpu")
    weights = (15 + 8) * 4
    assert est.optimizer_bytes == 2 * weights
    # the update holds weights, gradients and both moments at once
    assert est.peak_bytes >= weights * 4
    assert est.train_bytes(50) > est.train_bytes(5)


def test_cuda_mode_rounds_to_512_byte_blocks():
    est = estimate_torch(tiny(), input_shape=(4,), batch_size=5, optimizer="adam", device="cuda")
    # every buffer is at least one 512-byte block, and the cuBLAS workspaces are counted
    assert est.peak_bytes % 512 == 0
    assert est.peak_bytes > 2 * 32 * 1024 ** 2


def test_mixed_precision_halves_kept_activations():
    fp32 = estimate_torch(tiny(), input_shape=(4,), batch_size=8, device="cpu")
    bf16 = estimate_torch(tiny(), input_shape=(4,), batch_size=8, device="cpu", precision="mixed_bfloat16")
    assert bf16.layers[1].activation_bytes_per_sample == fp32.layers[1].activation_bytes_per_sample // 2
    assert bf16.param_bytes == fp32.param_bytes  # fp32 masters


@pytest.mark.parametrize("opt, slots", [
    ("sgd", 0), ("momentum", 1), ("adam", 2), ("adamw", 2), ("rmsprop", 1), ("adagrad", 1),
    (lambda p: torch.optim.Adam(p, amsgrad=True), 3),
])
def test_torch_slots_read_from_the_optimizer(opt, slots):
    if callable(opt):
        opt = opt([nn.Parameter(torch.zeros(2))])
    assert torch_optimizer(opt).slots_per_weight == slots


def test_attention_keeps_no_score_matrix_on_cuda():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum(dim=(1, 3))

    seq = 256
    cuda = estimate_torch(Attn(), input_shape=(seq, 16), batch_size=2, device="cuda", loss="sum")
    cpu_math = estimate_torch(Attn(), input_shape=(seq, 16), batch_size=2, device="cpu", loss="sum")
    scores = 2 * 2 * seq * seq * 4  # batch x heads x seq x seq fp32
    out_and_lse = 2 * 2 * seq * 8 * 4 + 2 * 2 * seq * 4 + 16  # what the fused kernel keeps (and 2 RNG words)
    assert cpu_math.activation_bytes() - cuda.activation_bytes() >= scores - out_and_lse


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="give example_input"):
        estimate_torch(tiny(), batch_size=2)
    with pytest.raises(ConfigError, match="needs a torch.nn.Module"):
        estimate_torch(object(), input_shape=(4,))
    with pytest.raises(ConfigError, match="could not run Sequential on the meta device"):
        estimate_torch(tiny(), input_shape=(5,), batch_size=2)


class _NewGELU(nn.Module):
    def forward(self, f):  # GPT-2's tanh GELU: torch.pow runs in fp32 under autocast, so the rest does too
        return 0.5 * f * (1.0 + torch.tanh(0.79 * (f + 0.044715 * torch.pow(f, 3.0))))


class _Block(nn.Module):
    """A transformer block's ops whose autocast dtypes differ: norms, matmuls, softmax, pow, GELU."""

    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = _NewGELU()
        self.out = nn.Linear(4 * d, d)
        self.ln2 = nn.LayerNorm(d)
        self.gn = nn.GroupNorm(2, d)

    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        x = x + a
        f = self.act(self.fc(x))
        y = self.out(f)
        x = x + self.ln2(y)  # a norm of a bf16 matmul output: fp32 under autocast
        return self.gn(y.transpose(1, 2)).transpose(1, 2).sum(dim=-1)


def _dtypes(model, run):
    seen = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: seen.append((type(m).__name__, o.dtype)))
    try:
        out = run()
    finally:
        hook.remove()
    return seen + [("(output)", out.dtype)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_emulation_matches_cuda_autocast(dtype):
    """The meta-device emulation gives every module the output dtype real CUDA autocast gives it
    (fake CUDA tensors run autocast's own kernels in a forward pass, no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from distmem.estimate.torch.autocast import AutocastMode
    model = _Block()
    with FakeTensorMode():
        x = torch.empty(2, 8, 16, device="cuda")
        state = {k: torch.empty(v.shape, device="cuda").requires_grad_(v.requires_grad)
                 for k, v in model.named_parameters()}
        was = torch.is_autocast_enabled("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        torch.autocast_increment_nesting()
        try:
            real = _dtypes(model, lambda: torch.func.functional_call(model, state, (x,)))
        finally:
            torch.autocast_decrement_nesting()
            torch.set_autocast_enabled("cuda", was)
            torch.clear_autocast_cache()
    xm = torch.empty(2, 8, 16, device="meta")
    meta_state = {k: torch.empty(v.shape, device="meta").requires_grad_(v.requires_grad)
                  for k, v in model.named_parameters()}
    with AutocastMode(dtype):
        ours = _dtypes(model, lambda: torch.func.functional_call(model, meta_state, (xm,)))
    assert ours == real
    # the test has teeth: norms of bf16 inputs and the pow-based GELU come out in fp32
    assert [d for k, d in real if k in ("LayerNorm", "GroupNorm", "_NewGELU")] == [torch.float32] * 4
    assert ("Linear", dtype) in real


def test_autocast_keeps_fp32_norm_inputs_and_one_cast_per_weight():
    """Under autocast a LayerNorm after a Linear keeps an fp32 copy of its input and the Linear's
    weight is cast once per forward (autocast's cache), however often it is used."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64, bias=False)
            self.ln = nn.LayerNorm(64)

        def forward(self, x):
            return self.ln(self.lin(self.lin(x)))

    bf16 = estimate_torch(Twice(), input_shape=(64,), batch_size=32, device="cpu", precision="bf16", loss="sum")
    fp32 = estimate_torch(Twice(), input_shape=(64,), batch_size=32, device="cpu", loss="sum")
    row = {r.kind: r for r in bf16.layers}
    # Linear keeps bf16 casts of the input (32x64), of its first output (32x64) and one of the weight (64x64)
    assert row["Linear"].activation_bytes(32) == 2 * (32 * 64 + 32 * 64 + 64 * 64)
    # LayerNorm runs in fp32: besides what it keeps in fp32 training (its output here, and per-row
    # statistics) it keeps the fp32 copy of its bf16 input, made inside it
    fp32_ln = {r.kind: r for r in fp32.layers}["LayerNorm"].activation_bytes(32)
    assert row["LayerNorm"].activation_bytes(32) == fp32_ln + 32 * 64 * 4


def _resnetish():
    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[Block(16) for _ in range(4)], nn.Flatten(),
                         nn.Dropout(0.1), nn.Linear(16 * 16 * 16, 10))


def _wide():  # weights dwarf activations: the peak is in the optimizer update
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))


@pytest.mark.parametrize("build, shape", [(_resnetish, (3, 16, 16)), (_wide, (512,))])
@pytest.mark.parametrize("opt", ["adam", "momentum", "adafactor"])
def test_fast_paths_change_nothing(monkeypatch, opt, build, shape):
    """Replaying later steps from the first one's trace and reusing meta-kernel answers give the
    same peaks, step by step, as simulating every step and running every meta kernel."""
    import distmem.estimate.torch.estimate as ft
    fast = estimate_torch(build(), input_shape=shape, batch_size=8, optimizer=opt)
    monkeypatch.setattr(ft, "REPLAY_LATER_STEPS", False)
    monkeypatch.setattr(ft, "MEMO_META_OPS", False)
    slow = estimate_torch(build(), input_shape=shape, batch_size=8, optimizer=opt)
    assert fast.peak_detail()["steps"] == slow.peak_detail()["steps"]
    assert [r.activation_bytes(8) for r in fast.layers] == [r.activation_bytes(8) for r in slow.layers]
    if build is _wide and opt == "adam":
        assert fast.peak_detail()["phase"] == "update"  # the case that would show state counted twice


def test_item_on_meta_is_answered_with_a_warning():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h * 2 if bool((h > 0).all()) else h  # a data-dependent branch

    with pytest.warns(UserWarning, match="read a tensor's value"):
        est = estimate_torch(Gate(), input_shape=(4,), batch_size=2, device="cpu")
    assert any("module '(model)'" in w or "module ''" in w or "Gate" in w or "read a tensor" in w
               for w in est.warnings)


def test_cuda_dropout_keeps_a_one_byte_mask():
    """On CUDA, dropout is the fused kernel keeping a bool mask; the meta/CPU decomposition keeps a
    mask in the input's dtype. A CUDA estimate must model the former."""
    model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.1), nn.Linear(256, 256))
    cuda = estimate_torch(model, input_shape=(256,), batch_size=64, device="cuda", loss="sum")
    cpu = estimate_torch(model, input_shape=(256,), batch_size=64, device="cpu", loss="sum")
    drop_cuda = {r.kind: r for r in cuda.layers}["Dropout"].activation_bytes_per_sample
    drop_cpu = {r.kind: r for r in cpu.layers}["Dropout"].activation_bytes_per_sample
    assert drop_cuda == 256 * 1 + 256 * 4  # the mask (1 byte) and the dropped output, read by the Linear
    assert drop_cpu == 256 * 4 + 256 * 4


def test_attention_with_a_learned_bias_keeps_the_score_matrix_on_cuda():
    """A bias that needs its gradient leaves CUDA only the math kernel (T5's relative positions),
    which keeps the score matrix; a fixed bias goes to the fused kernel, which does not."""
    class Biased(nn.Module):
        def __init__(self, learned):
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.bias = nn.Parameter(torch.zeros(1, 2, 128, 128), requires_grad=learned)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).sum(dim=(1, 3))

    learned = estimate_torch(Biased(True), input_shape=(128, 16), batch_size=2, device="cuda", loss="sum")
    fixed = estimate_torch(Biased(False), input_shape=(128, 16), batch_size=2, device="cuda", loss="sum")
    scores = 2 * 2 * 128 * 128 * 4  # batch x heads x seq x seq, fp32: the softmax output the math kernel keeps
    assert learned.activation_bytes() >= scores > 2 * fixed.activation_bytes()


def test_cudnn_workspace_rules_as_measured_on_h200():
    import torch
    from distmem.estimate.torch.kernels import cudnn_workspace
    m = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    # 1x1 stride-1 weight gradient: float32 split-K partials, at most one per image and one per 196
    # positions of the reduction (SqueezeNet's classifier took 64: 125 MiB; the bound allows 56)
    args = (m(64, 1000, 13, 13), m(64, 512, 13, 13), m(1000, 512, 1, 1), None, [1, 1], [0, 0], [1, 1], False,
            [0, 0], 1, [True, True, True])
    assert cudnn_workspace("convolution_backward", args) == 56 * 1000 * 512 * 4
    # at 7x7 (ResNet-50's last stage, 32 images) few partials, not 32
    last = (m(32, 2048, 7, 7), m(32, 512, 7, 7), m(2048, 512, 1, 1), None, [1, 1], [0, 0], [1, 1], False,
            [0, 0], 1, [True, True, True])
    assert cudnn_workspace("convolution_backward", last) == 8 * 2048 * 512 * 4
    # depthwise: torch's own kernels, none
    dw = (m(8, 32, 56, 56), m(32, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32)
    assert cudnn_workspace("convolution", dw) == 0
    # a 3x3 float32 convolution: NHWC copies of input, output and weight
    c3 = (m(2, 16, 8, 8), m(32, 16, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert cudnn_workspace("convolution", c3) == (2 * 16 * 64 + 2 * 32 * 64 + 32 * 16 * 9) * 4


def test_adafactor_runs_its_for_loop_on_cuda_as_torch_does():
    import torch
    from distmem.estimate.torch.simulate import foreach_as_torch_picks
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    ada, adam = torch.optim.Adafactor(p), torch.optim.Adam(p)
    foreach_as_torch_picks(ada, cuda=True)
    foreach_as_torch_picks(adam, cuda=True)
    assert ada.param_groups[0]["foreach"] is False and adam.param_groups[0]["foreach"] is True


class _GroupedKV(nn.Module):
    """Causal attention over grouped K/V (4 query heads, 2 key/value heads), as Hugging Face's
    Mistral / Qwen2 call it (``enable_gqa=True``, no mask)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        b, s = x.shape[:2]
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum(dim=(1, 3))


@pytest.mark.parametrize("grouped_efficient", [False, True])
def test_grouped_kv_in_float32_runs_the_kernel_cuda_runs(monkeypatch, grouped_efficient):
    """Flash attention does not take float32; where CUDA's memory-efficient attention takes no grouped
    K/V either (torch 2.11 on the H200: Mistral and Qwen2 in float32 held 0.55-0.64 GiB more than
    estimated, the same at every N), CUDA runs the math kernel, which keeps the score matrix; where it
    takes them, the fused kernel keeps the output and a log-sum-exp only. Under bf16 autocast flash
    takes grouped K/V either way."""
    from distmem.estimate.torch import kernels
    monkeypatch.setattr(kernels, "EFFICIENT_ATTENTION_GROUPED_KV", grouped_efficient, raising=False)
    seq, batch = 256, 2
    scores = batch * 4 * seq * seq * 4  # batch x query heads x seq x seq, float32
    fp32 = estimate_torch(_GroupedKV(), input_shape=(seq, 32), batch_size=batch, device="cuda", loss="sum")
    bf16 = estimate_torch(_GroupedKV(), input_shape=(seq, 32), batch_size=batch, device="cuda", loss="sum",
                          precision="mixed_bfloat16")
    if grouped_efficient:
        assert fp32.activation_bytes() < scores / 2
    else:
        assert fp32.activation_bytes() >= scores  # the math kernel's softmax output, kept for the backward
    assert bf16.activation_bytes() < scores / 4


def test_sdpa_kernel_is_picked_as_cudas_dispatcher_picks_it():
    from distmem.estimate.torch.kernels import sdpa_kernel
    m = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    q32, k32, q16, k16 = m(2, 4, 64, 8), m(2, 2, 64, 8), m(2, 4, 64, 8, dt=torch.bfloat16), m(2, 2, 64, 8, dt=torch.bfloat16)
    mask = m(1, 1, 64, 64)
    assert sdpa_kernel(q16, q16, None, False, False) == "flash"
    assert sdpa_kernel(q32, q32, None, False, False) == "efficient"
    assert sdpa_kernel(q16, q16, mask, False, False) == "efficient"
    assert sdpa_kernel(q16, k16, None, True, False) == "flash"  # flash reads grouped K/V as they are
    assert sdpa_kernel(q32, k32, None, True, False) == "math"
    assert sdpa_kernel(q32, k32, None, True, True) == "efficient"
    assert sdpa_kernel(q16, k16, mask, True, False) == "math"
    learned = m(1, 1, 64, 64).requires_grad_()
    assert sdpa_kernel(q16, q16, learned, False, True) == "math"


def test_the_dispatch_mode_lets_its_tracker_go_without_a_collection():
    """A mode class made per call sits in a reference cycle with its closure, so the tracker (and
    whatever its rows reach) stayed alive until the next garbage collection."""
    import gc
    import weakref
    from distmem.estimate.allocators import ExactAllocator
    from distmem.estimate.torch.dispatch import Tracker, dispatch_mode
    gc.collect()
    gc.disable()
    try:
        tracker = Tracker(ExactAllocator())
        with dispatch_mode(tracker):
            torch.empty(3, device="meta") + 1
        ref = weakref.ref(tracker)
        del tracker
        assert ref() is None
    finally:
        gc.enable()


def test_half_precision_forward_convolutions_take_the_nhwc_copies_measured_on_h200():
    """A frozen backbone's peak is a forward one, where cuDNN's half-precision convolutions hold
    NHWC copies of their input (channels padded to 8 under bf16, 4 under fp16), output and weight
    (frozen ResNet-50, batch 128, H200: each convolution's hidden bytes matched to the byte,
    bench/results/estimate_half_forward_probe_h200.json). The rule before gave none in half precision,
    and fit planned the frozen ResNet-50 at batch 128 under bf16 at 889 MiB where it held 938 MiB:
    its chosen layout ran out of memory (the unseen set of bench/plan/fit_scale.py)."""
    import torch
    from distmem.estimate.torch.kernels import cudnn_workspace
    MiB = 2 ** 20

    def conv(x_shape, w_shape, stride, padding, dt):
        x = torch.empty(x_shape, dtype=dt, device="meta")
        w = torch.empty(w_shape, dtype=dt, device="meta")
        return (x, w, None, stride, padding, [1, 1], False, [0, 0], 1)
    bf, fp = torch.bfloat16, torch.float16
    # measured hidden bytes minus the autocast cast of the stem's float32 input (36.75 MiB), which
    # the step's simulation counts as its own buffer
    stem_bf = cudnn_workspace("convolution", conv((128, 3, 224, 224), (64, 3, 7, 7), [2, 2], [3, 3], bf))
    stem_fp = cudnn_workspace("convolution", conv((128, 3, 224, 224), (64, 3, 7, 7), [2, 2], [3, 3], fp))
    assert round(stem_bf / MiB + 36.75, 1) == 330.8 and round(stem_fp / MiB + 36.75, 1) == 281.8
    # 3x3 (layer1.x.conv2), 1x1 stride 2 (layer2.0.downsample.0), large 1x1 (layer4.0.conv1)
    assert round(cudnn_workspace("convolution", conv((128, 64, 56, 56), (64, 64, 3, 3), [1, 1], [1, 1], bf)) / MiB, 1) == 98.1
    assert round(cudnn_workspace("convolution", conv((128, 256, 56, 56), (512, 256, 1, 1), [2, 2], [0, 0], bf)) / MiB, 1) == 294.2
    assert round(cudnn_workspace("convolution", conv((128, 1024, 14, 14), (512, 1024, 1, 1), [1, 1], [0, 0], fp)) / MiB, 1) == 74.5
    # a smaller 1x1 stride-1 (layer3.x.conv1) read NCHW as it is; float32 keeps its own rule
    assert cudnn_workspace("convolution", conv((128, 1024, 14, 14), (256, 1024, 1, 1), [1, 1], [0, 0], bf)) == 0
    f32 = conv((2, 16, 8, 8), (32, 16, 3, 3), [1, 1], [1, 1], torch.float32)
    assert cudnn_workspace("convolution", f32) == (2 * 16 * 64 + 2 * 32 * 64 + 32 * 16 * 9) * 4


def test_a_frozen_backbones_forward_peak_under_autocast_is_what_the_h200_held():
    """ResNet-50 fine-tuning its head alone, batch 128: the H200 held 938.4 MiB at the peak under
    bf16 and fp16 autocast (bench/results/estimate_half_forward_probe_h200.json); the model answered 888.7
    MiB before the half-precision forward rule."""
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.resnet50()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    for precision in ("mixed_bfloat16", "mixed_float16"):
        est = estimate_torch(model, input_shape=(3, 224, 224), batch_size=128, optimizer="adam",
                             precision=precision, device="cuda")
        assert abs(est.train_bytes(128) / 2 ** 20 / 938.4 - 1) < 0.01, (precision, est.train_bytes(128) / 2 ** 20)


def test_grouped_mm_experts_in_float32_are_sized_where_the_meta_kernel_refuses_them():
    """Hugging Face's ``grouped_mm`` experts call ``torch._grouped_mm`` on float32 expert weights;
    CUDA runs it in float32 and autocast leaves it so (H200, torch 2.11), but its meta function
    takes bfloat16 alone: the estimate (and ``fit`` on a Mixtral config) refused the model. Its
    output is sized from the operands' ranks, forward and backward."""
    class Experts(nn.Module):
        def __init__(self, d=64, f=128, e=4):
            super().__init__()
            self.router = nn.Linear(d, e)
            self.up = nn.Parameter(torch.randn(e, f, d) * 0.02)
            self.down = nn.Parameter(torch.randn(e, d, f) * 0.02)

        def forward(self, x):
            t = x.reshape(-1, x.shape[-1])
            idx = self.router(t).argmax(-1)
            perm = torch.argsort(idx, stable=True)
            counts = torch.histc(idx.float(), bins=self.up.shape[0], min=0, max=self.up.shape[0] - 1)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(t[perm], self.up.transpose(-2, -1), offs=offs)
            y = torch._grouped_mm(torch.relu(h), self.down.transpose(-2, -1), offs=offs)
            return y[torch.argsort(perm)].reshape(x.shape)
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    model = nn.Sequential(nn.Linear(32, 64), Experts(), nn.Linear(64, 10))
    tokens = 16 * 8
    for precision in ("float32", "mixed_bfloat16"):
        est = estimate_torch(model, input_shape=(8, 32), batch_size=16, optimizer="adam", precision=precision,
                             device="cuda")
        # at least the experts' two float32 outputs, kept for the backward
        assert est.train_bytes(16) > est.state_floor + tokens * (128 + 64) * 4, precision
