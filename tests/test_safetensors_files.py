"""The safetensors files packlora writes (adapters, checkpoints, packed models) against
safetensors' own writer and reader: the same bytes where that writer is deterministic, the same
bytes from run to run where it is not, and clear errors for what the format cannot hold."""
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from packlora.fileio import save_safetensors
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]


def arrays():
    rng = np.random.default_rng(0)
    return {"layers.1.lora_B.weight": rng.standard_normal((5, 3)).astype(np.float32),
            "layers.0.lora_A.weight": rng.standard_normal((3, 7)).astype(np.float32),
            "absmax": rng.standard_normal(9).astype(np.float16),
            "codes": rng.integers(0, 255, (4, 33), dtype=np.uint8),
            "step": np.array(12, np.int64),
            "empty": np.zeros((0, 4), np.float32)}


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_same_bytes_as_safetensors_writer(tmp_path, metadata):
    """With at most one metadata key safetensors' writer is deterministic: packlora's file is
    byte for byte the one it writes (tensor order, alignment, header padding)."""
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_safetensors(ours, arrays(), metadata)
    save_file(arrays(), str(theirs), metadata=metadata)
    assert ours.read_bytes() == theirs.read_bytes()


def test_safetensors_reads_back_every_tensor_and_key(tmp_path):
    path = tmp_path / "a.safetensors"
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    meta = {"format": "pt", "packlora.base": '{"name": "Modèle-7B"}', "step": "3"}
    save_safetensors(path, {**arrays(), "be": big_endian[:, ::-1]}, meta)
    got = load_file(str(path))
    for name, a in {**arrays(), "be": big_endian[:, ::-1]}.items():
        assert got[name].dtype == a.dtype.newbyteorder("=") and got[name].shape == a.shape
        np.testing.assert_array_equal(got[name], a)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == meta


_WRITE = """
import hashlib, sys
import numpy as np
from packlora.fileio import save_safetensors
meta = {k: k.upper() for k in ("format", "packlora.base", "step", "seed", "run")}
save_safetensors(sys.argv[1], {"w": np.ones((2, 2), np.float32)}, meta)
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())
"""


def test_same_bytes_from_process_to_process(tmp_path):
    """safetensors orders metadata keys by a hash seeded per process (five keys: 120 orders);
    packlora's files do not depend on the process that wrote them."""
    digests = set()
    for i in range(3):
        out = subprocess.run([sys.executable, "-c", _WRITE, str(tmp_path / f"{i}.safetensors")],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        digests.add(out.stdout.strip())
    assert len(digests) == 1
    data = (tmp_path / "0.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() in digests


def test_unstorable_dtype_is_refused_and_nothing_written(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="'z'.*complex64"):
        save_safetensors(path, {"z": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="str to str"):
        save_safetensors(path, {"w": np.zeros(2, np.float32)}, {"step": 3})
    assert list(tmp_path.iterdir()) == []
