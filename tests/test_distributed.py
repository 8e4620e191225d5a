"""Data-parallel fine-tuning under `mpiexec -n 2` (the mpich wheel's launcher): per-step losses
and the final adapter equal one process with the same global batch, one run folder is written,
a stopped run resumes under mpiexec to the same result, and bad launches end with a clear error
instead of a hang."""
import json
import os
import subprocess
import sys
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest
import yaml
from packlora.memory import plan
from safetensors.numpy import load_file

MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = pytest.mark.skipif(not MPIEXEC.is_file(),
                                reason="no mpiexec: pip install 'packlora[mpi]'")
CLI = "import sys; from packlora.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mpi")
    mf.tiny_chat_model(d / "model")
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(16):  # ragged: answers of 1 to 3 numbers, so rows hold different targets
        a = [int(v) for v in rng.integers(0, 5, int(rng.integers(1, 4)))]
        rows.append({"messages": [{"role": "user", "content": "+".join(map(str, a))},
                                  {"role": "assistant", "content": " ".join(map(str, a))}]})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def config(d, out, **train):
    t = {"max_steps": 4, "batch_size": 4, "grad_accum": 2, "lr": 5e-3, "warmup_steps": 1,
         "eval_every": 0, "save_every": 2, "keep_last": 3, "seed": 0}
    t.update(train)
    cfg = {"model": str(d / "model"), "quant": {"format": "nf4"},
           "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
           "data": {"train": str(d / "train.jsonl"), "max_seq_len": 64}, "train": t,
           "resume": "auto", "output_dir": str(out)}
    path = Path(f"{out}.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cfg, ranks=None, extra=(), timeout=240, env=None):
    launcher = [str(MPIEXEC), "-n", str(ranks)] if ranks else []
    cmd = launcher + [sys.executable, "-c", CLI, "finetune", str(cfg), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def adapter(out):
    return load_file(str(out / "adapter_model.safetensors"))


def assert_close(got, want):
    np.testing.assert_allclose(losses(got), losses(want), rtol=1e-5)
    a, b = adapter(got), adapter(want)
    assert a.keys() == b.keys()
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.fixture(scope="module")
def single(files):
    out = files / "single"
    done = run(config(files, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def two_ranks(files):
    out = files / "two"
    done = run(config(files, out), ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_two_ranks_equal_one_process_with_the_global_batch(single, two_ranks):
    assert_close(two_ranks, single)
    written = sorted(p.name for p in two_ranks.iterdir())
    assert written == ["adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
                       "checkpoints", "loss.png", "metrics.jsonl", "run_config.yaml"]
    assert len(losses(two_ranks)) == 4  # one writer: no line twice


def test_stop_and_resume_under_mpiexec(files, single, two_ranks, tmp_path):
    out = files / "resumed"
    assert run(config(files, out, max_steps=4), ranks=2).returncode == 0
    ckpt = out / "checkpoints"
    for p in (ckpt / "step-4", out / "adapter_model.safetensors"):  # as if stopped after step 3
        subprocess.run(["rm", "-rf", str(p)], check=True)
    done = run(config(files, out), ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(out) == losses(two_ranks)
    for k, v in adapter(two_ranks).items():
        np.testing.assert_array_equal(adapter(out)[k], v, err_msg=k)


def test_batch_that_does_not_divide_is_a_clear_error(files):
    done = run(config(files, files / "odd", batch_size=3), ranks=2, timeout=120)
    assert done.returncode != 0
    assert "train.batch_size: 3 is the global batch and must divide by the 2 ranks" in done.stderr
    assert "Traceback" not in done.stderr


def in_two_folders(cfg, a, b, out):
    """mpiexec of two ranks, the first working in folder a, the second in b."""
    one = [sys.executable, "-c", CLI, "finetune", str(cfg), f"output_dir={out}", "--quiet"]
    cmd = [str(MPIEXEC), "-n", "1", "-wdir", str(a), *one, ":", "-n", "1", "-wdir", str(b), *one]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_ranks_that_find_other_files_are_refused(files, tmp_path):
    """One config, relative paths, and each rank's folder holding other data or another model:
    the ranks trained on what each found, without a word. The same files run, and the result
    line is printed once (it was printed by every rank)."""
    cfg = yaml.safe_load(config(files, tmp_path / "unused").read_text())
    cfg.update(model="model", data=dict(cfg["data"], train="train.jsonl"), resume=None)
    path = tmp_path / "rel.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = (files / "train.jsonl").read_text().splitlines(keepends=True)
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        mf.tiny_chat_model(folder / "model")
        (folder / "train.jsonl").write_text("".join(rows))
    done = in_two_folders(path, a, b, tmp_path / "same")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 1 and '"steps": 4' in done.stdout
    (b / "train.jsonl").write_text("".join(rows[::-1]))
    done = in_two_folders(path, a, b, tmp_path / "data")
    assert done.returncode != 0 and "ranks were given different training data" in done.stderr
    assert "each rank reads data.train and data.valid on its own machine" in done.stderr
    (b / "train.jsonl").write_text("".join(rows))
    mf.tiny_chat_model(b / "model", seed=1)
    done = in_two_folders(path, a, b, tmp_path / "model")
    assert done.returncode != 0 and "ranks were given different base models" in done.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "model").exists()


def on_two_ranks(code, cfg):
    """mpiexec -n 2 of a Python snippet (argv[1] is the config), bounded in time: no hang."""
    return subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-c", code, str(cfg)],
                          capture_output=True, text=True, timeout=120)


ONE_RANK_DIFFERS = ("import os, sys; from packlora.cli import main; "
                    "extra = [{arg!r}] if os.environ['PMI_RANK'] == '1' else []; "
                    "sys.exit(main(['finetune', sys.argv[1], *extra, '--quiet']))")


def test_ranks_with_different_configs_are_refused(files):
    done = on_two_ranks(ONE_RANK_DIFFERS.format(arg="train.lr=0.1"),
                        config(files, files / "diff"))
    assert done.returncode != 0 and "given different configs" in done.stderr


def test_a_rank_that_fails_before_training_ends_the_others(files):
    """A bad command line on one rank only: it exits at once, and must take the others along."""
    done = on_two_ranks(ONE_RANK_DIFFERS.format(arg="--no-such-flag"),
                        config(files, files / "badarg"))
    assert done.returncode != 0 and "unrecognized arguments: --no-such-flag" in done.stderr


def test_a_rank_that_dies_ends_the_others(files):
    code = ("import os, sys; from packlora.training.trainer import Trainer; "
            "real = Trainer.train_step\n"
            "def step(self):\n"
            "    if self.world.rank == 1 and self.step == 2: os._exit(9)\n"
            "    return real(self)\n"
            "Trainer.train_step = step\n"
            "from packlora.cli import main\n"
            "sys.exit(main(['finetune', sys.argv[1], '--quiet']))")
    done = on_two_ranks(code, config(files, files / "dies", max_steps=50, save_every=0))
    assert done.returncode != 0


def test_mpi4py_missing_under_a_launcher_is_a_clear_error(files):
    code = ("import sys; sys.modules['mpi4py'] = None; from packlora.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "finetune", str(config(files,
                           files / "nompi")), "--quiet"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PMI_SIZE="2"))
    assert done.returncode == 2
    assert "mpi4py is not installed: pip install 'packlora[mpi]'" in done.stderr


def test_memory_report_plans_one_rank_and_the_allreduce_buffer(files):
    cfg = config(files, files / "plan", batch_size=4, grad_accum=1)
    one, two = plan(cfg), plan(cfg, ranks=2)
    assert two["run"]["batch_size"] == 2 and two["plan"]["distributed"]["ranks"] == 2
    params = one["plan"]["categories"]["adapters"]
    assert two["plan"]["distributed"]["allreduce_bytes"] == params
    assert two["plan"]["categories"]["workspace"] == params
    assert one["plan"]["categories"]["workspace"] == 0
    assert two["plan"]["categories"]["activations"] < one["plan"]["categories"]["activations"]


def test_ranks_of_a_machine_take_its_gpus_in_turn():
    from packlora.training.distributed import rank_gpu, shared_gpu
    assert [rank_gpu(0, r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [rank_gpu(2, r, 4) for r in range(3)] == [2, 3, 0]
    assert [rank_gpu(0, r, 1) for r in range(3)] == [0, 0, 0]  # CUDA_VISIBLE_DEVICES per rank
    assert shared_gpu(["a", "b", "c"]) is None
    assert shared_gpu(["a", "b", "a", "b"]) == (0, 2, "a")


# Each rank under mpiexec asks its World for `device: cuda:0` on a machine with `count` GPUs
# (a stand-in Device: this machine has none) and writes the GPU it got, or the error, to a file
# of its own in argv[1] (the ranks' stdout can reach the launcher interleaved).
GPU_PER_RANK = """
import json, pathlib, sys
from packlora.errors import ConfigError
from packlora.training import distributed
class FakeGpu:
    def __init__(self, kind, index, autodiff):
        self.index, self.bus_id = index, f"0000:{{index:02d}}:00.0"
    cuda_count = staticmethod(lambda: {count})
distributed.Device = FakeGpu
world = distributed.World.detect()
try:
    got = world.device("cuda:0").index
except ConfigError as e:
    got = str(e)
result = json.dumps([world.rank, list(world.node()[:2]), got])
(pathlib.Path(sys.argv[1]) / f"rank{{world.rank}}.json").write_text(result)
"""


@pytest.mark.parametrize("count", [2, 1])
def test_ranks_on_one_machine_get_a_gpu_each_or_a_clear_error(count, tmp_path):
    done = on_two_ranks(GPU_PER_RANK.format(count=count), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if count == 2:
        assert ranks == [[0, [0, 2], 0], [1, [1, 2], 1]]
        return
    for _, node, err in ranks:
        assert node[1] == 2
        assert err == ("device: cuda:0 with 2 ranks on this machine: its ranks 0 and 1 would "
                       "share GPU 0000:00:00.0 (1 visible to each); start at most one rank per "
                       "GPU, or give each its own through CUDA_VISIBLE_DEVICES")


def _fake_cupy(monkeypatch, available):
    """cupy as the NCCL sum sees it: cupy.cuda.nccl is a submodule cupy.cuda does not import."""
    import types
    made = []
    nccl = types.SimpleNamespace(available=available, get_unique_id=lambda: b"uid",
                                 NcclCommunicator=lambda *a: made.append(a))
    cuda = types.ModuleType("cupy.cuda")
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, mod)
    return made


@pytest.mark.parametrize("available", [True, False])
def test_nccl_is_imported_as_cupy_ships_it(monkeypatch, available):
    import types
    from packlora.errors import ConfigError
    from packlora.training.distributed import NcclSum
    made = _fake_cupy(monkeypatch, available)
    world = types.SimpleNamespace(size=2, rank=0, is_main=True, broadcast=lambda obj: obj)
    if available:
        NcclSum(world)
        assert made == [(2, b"uid", 0)]
        return
    with pytest.raises(ConfigError, match="NCCL, which cupy cannot load here"):
        NcclSum(world)
