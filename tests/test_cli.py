import subprocess
import sys

import tandem


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=120
    )


def test_help_works():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "Mixture-of-Experts" in result.stdout


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"tandem {tandem.__version__}"
