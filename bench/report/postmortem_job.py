"""One rank of a post-mortem scenario: a data-parallel (or 2-stage pipeline) training job with
``distmem.init()`` first, real steps (forward, backward, Adam, gradients averaged over Gloo), run
under torchrun or mpirun by ``bench/report/postmortem_scenarios.py``, and going out of memory the
way jobs do (``--scenario``). The remedies a post-mortem names are its options (``--micro-batch``,
``--samples-per-rank``, ``--keep cpu``...): the rerun applies the one it named.

Every rank writes ``RUN_DIR/truth-RANK.json`` as it ends (trained, or out of memory at which step
and when, by its own clock); a rank that fail fast stopped writes none. With
``DISTMEM_FAKE_GPU=1`` the GPU is the CPU stand-in (``postmortem_cpu.py``).

    python bench/report/postmortem_job.py --hog RUN_DIR KEEP_BYTES   # a foreign process: holds the GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
CPU = os.environ.get("DISTMEM_FAKE_GPU") == "1"
if CPU:
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu", "progs", "fakegpu"))  # its pynvml, before distmem's import

MiB = 1024 ** 2
SCENARIOS = ("uneven_batch", "global_batch", "long_sequence", "growth", "pipeline_stage", "foreign_mid_run",
             "fragmentation", "outside_allocator")


# -- models, as users build them --------------------------------------------------------------

def mlp(width: int, depth: int, classes: int, inputs: Optional[int] = None) -> Any:
    import torch

    layers: List[Any] = [torch.nn.Linear(inputs or width, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


class TinyLM:
    """A decoder-only language model: token and position embeddings, pre-norm blocks of causal
    self-attention (scaled_dot_product_attention) and an MLP, a head over the vocabulary."""

    @staticmethod
    def build(vocab: int, dim: int, layers: int, heads: int, max_len: int) -> Any:
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
                self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
                self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

            def forward(self, x: Any) -> Any:
                b, t, _ = x.shape
                q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(a.transpose(1, 2).reshape(b, t, dim))
                return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

        class LM(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_len, dim)
                self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
                self.ln, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

            def forward(self, ids: Any) -> Any:
                x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
                for blk in self.blocks:
                    x = blk(x)
                return self.head(self.ln(x))

        return LM()


# -- the job ----------------------------------------------------------------------------------

def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--out", required=True, help="the run folder (truth files; DISTMEM_RUN_DIR is set by the bench)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--limit", default=None, help="distmem's limit= per rank (omitted: the equal split)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--classes", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank and step")
    p.add_argument("--uneven-rank", type=int, default=2)
    p.add_argument("--uneven-factor", type=int, default=8)
    p.add_argument("--uneven-from", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--long-rank", type=int, default=1)
    p.add_argument("--long-factor", type=int, default=16)
    p.add_argument("--long-at", type=int, default=2)
    p.add_argument("--micro", type=int, default=4, help="pipeline micro-batches in flight (GPipe)")
    p.add_argument("--stages", default=None, help="pipeline stage sizes as the plan was told (comma separated)")
    p.add_argument("--ramp-at", type=int, default=4, help="foreign_mid_run: the batch doubles from this step")
    p.add_argument("--pause-at", type=int, default=None, help="wait here for --wait-file (a foreign process)")
    p.add_argument("--wait-file", default=None)
    p.add_argument("--lengths", default="", help="fragmentation: sequence lengths, one per step")
    p.add_argument("--groups-per-step", type=int, default=2, help="outside_allocator: communicators made per step")
    p.add_argument("--estimate", action="store_true", help="note distmem's estimate of the model (note_estimate)")
    # the changes a post-mortem names
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--samples-per-rank", type=float, default=None)
    p.add_argument("--elements-per-rank", type=float, default=None)
    p.add_argument("--keep", choices=("gpu", "cpu"), default="gpu", help="growth: where the kept outputs live")
    p.add_argument("--from-report", default=None)
    p.add_argument("--foreign", default=None)
    p.add_argument("--overhead", default=None)
    p.add_argument("--reuse-group", action="store_true", help="outside_allocator: one communicator, made once")
    p.add_argument("--recompute", action="store_true")
    return p.parse_args(argv)


def launcher_rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def launcher_size() -> int:
    for key in ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


class Job:
    def __init__(self, a: argparse.Namespace):
        import torch
        import torch.distributed as dist

        self.a, self.torch, self.dist = a, torch, dist
        self.rank, self.size = launcher_rank(), launcher_size()
        self.truth: Dict[str, Any] = {"rank": self.rank, "scenario": a.scenario, "pid": os.getpid(), "steps_done": 0}
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(self.size))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", os.environ.get("PM_PORT", "29500"))
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        self.emu = None
        if CPU:
            import postmortem_cpu

            self.emu = postmortem_cpu.install()
        import distmem
        from distmem.observe import oom_record

        self.distmem, self.oom_record = distmem, oom_record
        options: Dict[str, Any] = {}
        if a.stages:
            options["stages"] = a.stages.split(",")
        self.plan = distmem.init(strategy="pipeline" if a.scenario == "pipeline_stage" else "data", framework="torch",
                                 memory="limit", limit=a.limit, foreign=a.foreign or 0, overhead=a.overhead,
                                 from_report=a.from_report, verbose=self.rank == 0,
                                 reserve="16MiB" if CPU else None, **options)
        if self.emu is not None:
            from distmem.guard import oom

            oom.use_allocator(self.emu)
        self.dev = torch.device("cpu") if CPU else torch.device("cuda", self.plan.mine.devices[0].index)
        torch.manual_seed(1234 + self.rank)

    # -- helpers --------------------------------------------------------------------------
    def write_truth(self) -> None:
        path = os.path.join(self.a.out, f"truth-{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.truth, f)
        os.replace(path + ".tmp", path)

    def average(self, model: Any) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = self.torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat)
        flat /= self.size
        start = 0
        for g in grads:
            g.copy_(flat[start:start + g.numel()].view_as(g))
            start += g.numel()

    def note(self, step: int, batch: Any) -> None:
        self.oom_record.note_step(step, batch)
        self.truth["step"] = step
        if os.environ.get("PM_DEBUG") and self.oom_record._state["steps"]:
            p = self.oom_record._state["steps"][-1]
            print(f"[pm rank {self.rank}] step {step}: entering {p.get('allocated_bytes', 0) / MiB:.0f} MiB, peak so far "
                  f"{p.get('peak_bytes', 0) / MiB:.0f} MiB, reserved {p.get('reserved_bytes', 0) / MiB:.0f} MiB, "
                  f"{p.get('samples')} samples / {p.get('elements')} elements", file=sys.stderr, flush=True)

    def pause(self, step: int) -> None:
        a = self.a
        if a.pause_at is not None and step == a.pause_at and a.wait_file:
            with open(os.path.join(a.out, f"paused-{self.rank}"), "w") as f:
                f.write(str(time.time()))
            deadline = time.time() + 90
            while not os.path.exists(a.wait_file) and time.time() < deadline:
                time.sleep(0.05)
            self.dist.barrier()

    def estimate(self, build: Any, batch: int, **kw: Any) -> None:
        """Note distmem's estimate of this rank's model (the public door, on the meta device)."""
        from distmem.estimate import estimate

        est = estimate(build(), batch_size=batch, optimizer="adam", method="model", device="cpu" if CPU else "cuda",
                       **kw)
        if self.emu is not None and self.emu.scale != 1:
            est = _Scaled(est, self.emu.scale)
        self.oom_record.note_estimate(est)

    def mlp_step(self, model: Any, opt: Any, x: Any, y: Any, micro: Optional[int] = None) -> Any:
        """One step over (x, y): micro-batches of ``micro`` samples with their gradients accumulated."""
        torch = self.torch
        opt.zero_grad(set_to_none=True)
        n = x.shape[0]
        m = micro or n
        loss_sum = 0.0
        out = None
        for i in range(0, n, m):
            xb, yb = x[i:i + m], y[i:i + m]
            if self.a.recompute:
                out = torch.utils.checkpoint.checkpoint_sequential(model, max(len(model) // 2, 1), xb,
                                                                    use_reentrant=False)
            else:
                out = model(xb)
            loss = torch.nn.functional.cross_entropy(out, yb) * (xb.shape[0] / n)
            loss.backward()
            loss_sum += float(loss.detach())
        self.average(model)
        opt.step()
        return out, loss_sum

    def data(self, n: int, width: int, classes: int) -> Any:
        torch = self.torch
        return torch.randn(n, width, device=self.dev), torch.randint(0, classes, (n,), device=self.dev)

    # -- scenarios ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            getattr(self, self.a.scenario)()
            self.truth["trained"] = True
        except self.torch.cuda.OutOfMemoryError as exc:
            self._oom(exc)
            raise
        except Exception as exc:  # noqa: BLE001 - NCCL's own out-of-memory reaches Python as its error
            if "out of memory" in str(exc).lower():
                self._oom(exc)
            else:
                self.truth.update(trained=False, error=f"{type(exc).__name__}: {exc}"[:800])
                self.write_truth()
            raise
        self.truth["finished_time"] = time.time()
        self.write_truth()

    def _oom(self, exc: BaseException) -> None:
        self.truth.update(trained=False, oom=True, oom_time=time.time(), oom_step=self.truth.get("step"),
                          error=f"{type(exc).__name__}: {str(exc)[:300]}")
        self.write_truth()

    def _mlp(self, classes: Optional[int] = None) -> Any:
        a, torch = self.a, self.torch
        model = mlp(a.width, a.depth, classes or a.classes).to(self.dev)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    def uneven_batch(self) -> None:
        a = self.a
        model, opt = self._mlp()
        for step in range(a.steps):
            n = a.batch
            if step >= a.uneven_from:
                if a.samples_per_rank:
                    n = int(a.samples_per_rank)  # the change: every rank its share of the global batch
                elif self.rank == a.uneven_rank:
                    n = a.batch * a.uneven_factor  # a shard the data loader did not split
            x, y = self.data(n, a.width, a.classes)
            self.note(step, x)
            self.mlp_step(model, opt, x, y, a.micro_batch)
            self.truth["steps_done"] = step + 1

    def global_batch(self) -> None:
        a = self.a
        if a.estimate:
            self.estimate(lambda: mlp(a.width, a.depth, a.classes), a.batch, input_shape=(a.width,))
        model, opt = self._mlp()
        for step in range(a.steps):
            x, y = self.data(a.batch, a.width, a.classes)
            self.note(step, x)
            self.mlp_step(model, opt, x, y, a.micro_batch)
            self.truth["steps_done"] = step + 1

    def growth(self) -> None:
        a = self.a
        model, opt = self._mlp()
        kept: List[Any] = []  # the outputs of every step, for an accuracy over the epoch
        for step in range(a.steps):
            x, y = self.data(a.batch, a.width, a.classes)
            self.note(step, x)
            out, _ = self.mlp_step(model, opt, x, y, a.micro_batch)
            if a.keep == "gpu":
                kept.append(out.detach())
            else:  # host memory (the CPU stand-in's host is numpy: its torch tensors are "the GPU")
                kept.append(out.detach().cpu() if not CPU else out.detach().numpy().copy())
            self.truth["steps_done"] = step + 1

    def foreign_mid_run(self) -> None:
        a = self.a
        model, opt = self._mlp()
        for step in range(a.steps):
            self.pause(step)
            n = a.batch * (2 if step >= a.ramp_at else 1)  # batch-size warm-up: the batch doubles
            x, y = self.data(n, a.width, a.classes)
            self.note(step, x)
            self.mlp_step(model, opt, x, y, a.micro_batch)
            self.truth["steps_done"] = step + 1

    def long_sequence(self) -> None:
        a, torch = self.a, self.torch
        longest = a.seq * a.long_factor
        model = TinyLM.build(a.vocab, a.dim, a.layers, 4, longest).to(self.dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        for step in range(a.steps):
            t = a.seq
            if step == a.long_at and self.rank == a.long_rank:
                t = longest  # one document of 16x the usual length: the batch is padded to it
            if a.elements_per_rank:
                t = min(t, max(int(a.elements_per_rank // a.batch), 1))  # the change: a token budget per rank
            ids = torch.randint(0, a.vocab, (a.batch, t), device=self.dev)
            self.note(step, ids)
            opt.zero_grad(set_to_none=True)
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            self.average(model)
            opt.step()
            self.truth["steps_done"] = step + 1

    def fragmentation(self) -> None:
        a, torch = self.a, self.torch
        lengths = [int(v) for v in a.lengths.split(",") if v] or [a.seq] * a.steps
        model = torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU(),
                                    torch.nn.Linear(a.width, a.width), torch.nn.GELU(),
                                    torch.nn.Linear(a.width, a.width)).to(self.dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        table: Dict[int, Any] = {}  # a position table per sequence length, built when a length first comes
        for step, t in enumerate(lengths[:a.steps]):
            x = torch.randn(a.batch, t, a.width, device=self.dev)
            self.note(step, x)
            opt.zero_grad(set_to_none=True)
            if t not in table:
                table[t] = torch.randn(t, a.width, device=self.dev) * 0.01
            loss = (model(x) + table[t]).square().mean()
            loss.backward()
            self.average(model)
            opt.step()
            self.truth["steps_done"] = step + 1

    def outside_allocator(self) -> None:
        a, torch = self.a, self.torch
        model, opt = self._mlp()
        backend = "gloo" if CPU else "nccl"
        reused = None
        groups: List[Any] = []
        for step in range(a.steps):
            x, y = self.data(a.batch, a.width, a.classes)
            self.note(step, x)
            loss = self.mlp_step(model, opt, x, y, a.micro_batch)[1]
            # a metric reduced over a group made for it each step (the leak); the fix makes it once
            made = 0
            if a.reuse_group:
                if reused is None:
                    reused = [self.dist.new_group([r], backend=backend) for r in range(self.size)][self.rank]
                    made = 1
                mine = reused
            else:
                fresh = [self.dist.new_group([r], backend=backend) for r in range(self.size)
                         for _ in range(a.groups_per_step)]
                mine_all = fresh[self.rank * a.groups_per_step:(self.rank + 1) * a.groups_per_step]
                groups += mine_all
                mine, made = mine_all[-1], a.groups_per_step
                for g in mine_all[:-1]:
                    self.dist.all_reduce(torch.ones(1, device=self.dev), group=g)
            if self.emu is not None:
                for _ in range(made):
                    self.emu.hold_outside(int(os.environ.get("PM_COMM_BYTES", str(8 * MiB))))
            self.dist.all_reduce(torch.tensor([loss], device=self.dev), group=mine)
            self.truth["steps_done"] = step + 1

    def pipeline_stage(self) -> None:
        a, torch, dist = self.a, self.torch, self.dist
        stage = self.plan.mine.stage
        half = a.depth // 2
        micro = a.batch // a.micro
        if stage == 0:
            model = mlp(a.width, half, a.width).to(self.dev)
        else:
            model = mlp(a.width, a.depth - half, a.classes).to(self.dev)
            if a.estimate:
                self.estimate(lambda: mlp(a.width, a.depth - half, a.classes), a.batch, input_shape=(a.width,))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        for step in range(a.steps):
            opt.zero_grad(set_to_none=True)
            if stage == 0:
                x = torch.randn(a.batch, a.width, device=self.dev)
                self.note(step, x)
                outs = []
                for i in range(a.micro):  # GPipe: every micro-batch forward, then every backward
                    o = model(x[i * micro:(i + 1) * micro])
                    dist.send(o.detach().cpu(), 1)
                    outs.append(o)
                for o in reversed(outs):
                    g = torch.empty(o.shape)
                    dist.recv(g, 1)
                    o.backward(g.to(self.dev))
            else:
                y = torch.randint(0, a.classes, (a.batch,), device=self.dev)
                self.note(step, a.batch)
                kept = []
                for i in range(a.micro):
                    h = torch.empty(micro, a.width)
                    dist.recv(h, 0)
                    h = h.to(self.dev).requires_grad_(True)
                    loss = torch.nn.functional.cross_entropy(model(h), y[i * micro:(i + 1) * micro]) / a.micro
                    kept.append((h, loss))
                for h, loss in reversed(kept):
                    loss.backward()
                    dist.send(h.grad.cpu(), 0)
            opt.step()
            self.truth["steps_done"] = step + 1


class _Scaled:
    """An estimate read through the CPU stand-in's scale (its allocator books ``scale`` x the bytes)."""

    def __init__(self, est: Any, scale: int):
        self.est, self.scale = est, scale
        self.batch_size, self.method, self.layers = est.batch_size, est.method, est.layers
        self.state_bytes = est.state_bytes * scale

    def train_bytes(self, batch: int) -> int:
        return int(self.est.train_bytes(batch)) * self.scale


def hog(run_dir: str, keep: int) -> None:
    """A process outside the job: takes all but ``keep`` bytes of the GPU's free memory and holds it."""
    if CPU:
        sys.path.insert(0, HERE)
        import postmortem_cpu

        dev = postmortem_cpu.Device(int(os.environ.get("DISTMEM_EMU_SCALE", "1")))
        take = max(dev.free_bytes() - keep, 0)
        dev._book(take)
        held = take
    else:
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        held, blocks = 0, []
        chunk = 256 * MiB
        while free - keep >= chunk:
            blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            held += chunk
            free, _ = torch.cuda.mem_get_info(0)
    with open(os.path.join(run_dir, "hog-ready"), "w") as f:
        json.dump({"pid": os.getpid(), "held_bytes": held}, f)
    time.sleep(3600)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--hog":
        hog(sys.argv[2], int(sys.argv[3]))
        return 0
    a = parse()
    Job(a).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
