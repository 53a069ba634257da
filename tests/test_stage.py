"""scripts/airgap/stage.py: the pinned serve set (fetched once, each file checked by sha256) and the rule
that no package has two wheels in the bundle (setup.sh installs them all in one pip call)."""

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "airgap"))
import stage  # noqa: E402


def test_the_serve_list_pins_the_server_and_its_client_and_no_package_of_the_shared_sets():
    names = [name for _, name in stage.read_listing(stage.SERVE_WHEELS)]
    assert {"fastapi", "uvicorn", "openai"} <= {stage.distribution(n) for n in names}
    assert all(n.endswith(".whl") and ("py3-none-any" in n or "cp312" in n) for n in names)
    shared = [stage.SHARED / "device-wheels" / f"{s}.sha256" for s in ("core", "workflow")]
    if not all(f.is_file() for f in shared):
        pytest.skip("../shared/device-wheels not here")
    listed = names + [name for f in shared for _, name in stage.read_listing(f)]
    assert stage.duplicates(listed) == {}


def test_duplicates_compares_normalized_distribution_names():
    assert stage.duplicates(["typing_extensions-4.16.0-py3-none-any.whl", "Typing.Extensions-4.15.0-py3-none-any.whl",
                             "anyio-4.16.0-py3-none-any.whl"]) == {
        "typing-extensions": ["Typing.Extensions-4.15.0-py3-none-any.whl", "typing_extensions-4.16.0-py3-none-any.whl"]}


def test_fetch_listed_keeps_a_cached_wheel_whose_sha256_matches_and_drops_one_that_does_not(tmp_path):
    wheel = tmp_path / "cache" / "demo-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"wheel bytes")
    listing = tmp_path / "demo.sha256"
    listing.write_text(f"{hashlib.sha256(b'wheel bytes').hexdigest()}  {wheel.name}\n")
    assert stage.fetch_listed(listing, wheel.parent) == [wheel]  # present and intact: no download
    wheel.write_bytes(b"another build")
    with pytest.raises(SystemExit, match="does not match its sha256"):
        stage.fetch_listed(listing, wheel.parent)
    assert not wheel.exists()


def test_a_piece_fits_beside_the_working_tree_in_one_device_call(tmp_path):
    """A call carries 64 MiB with the working tree: the default piece is what is left (less the margin), a
    larger --piece-mib stops before anything is packed, and the tree counts untracked files git does not
    ignore but not ignored ones (the pieces themselves live in an ignored folder)."""
    mib = 2**20
    assert stage.piece_mib(None, 14 * mib - 5) == 64 - 4 - 14
    assert stage.piece_mib(None, 14 * mib + 1) == 64 - 4 - 15  # a started MiB counts
    assert stage.piece_mib(40, 14 * mib) == 40
    with pytest.raises(SystemExit, match=r"--piece-mib 50: .*14\.0 MiB.*1\.\.46 MiB"):
        stage.piece_mib(50, 14 * mib)
    with pytest.raises(SystemExit, match="no room for a piece"):
        stage.piece_mib(None, 61 * mib)

    with pytest.raises(SystemExit, match="git ls-files.*stage from a git checkout"):
        stage.tree_bytes(tmp_path)  # not a checkout yet
    import subprocess
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "piece").write_bytes(b"x" * 5000)
    (tmp_path / "tracked.py").write_bytes(b"y" * 300)
    subprocess.run(["git", "add", "tracked.py", ".gitignore"], cwd=tmp_path, check=True)
    (tmp_path / "untracked.md").write_bytes(b"z" * 20)
    assert stage.tree_bytes(tmp_path) == 300 + 20 + len("ignored/\n")
