"""Every file in examples/ runs as a subprocess (examples are tested documentation).

Each example gets small settings here (fewer steps, the CPU) so the whole file takes seconds on
a 2-core CI machine; a new example with no entry in ARGS runs with no arguments.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# Small settings per example: enough steps for the loss to fall, on the CPU.
ARGS = {
    "moe_train.py": ["--steps", "40", "--device", "cpu", "--dtype", "float32"],
    "hf_moe_finetune.py": ["--steps", "6", "--device", "cpu", "--hidden", "32", "--lr", "3e-3"],
}


def run_example(path: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Runs from a source checkout too (the CI installs the package, which also works).
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _describe(proc: subprocess.CompletedProcess) -> str:
    return (f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-4000:]}")


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"moe_train.py", "custom_fusion.py"} <= names, names
    assert set(ARGS) <= names, f"ARGS names examples that do not exist: {set(ARGS) - names}"


@pytest.mark.slow  # subprocesses of seconds each; CI runs them
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path):
    proc = run_example(path, ARGS.get(path.name, []))
    assert proc.returncode == 0, _describe(proc)
    check = CHECKS.get(path.name)
    if check is not None:
        check(proc.stdout)


def _check_moe_train(out: str, expert_parallel: bool = False) -> None:
    assert "FusionPlan" in out
    if expert_parallel:  # the rows leave the rank: only the expert MLP fuses
        assert "ExpertDispatch[0]" in out and "ExpertCombine[4]" in out, "routing ops missing"
        assert "GroupedMLP[1, 2, 3]" in out, "the grouped MLP fusion did not fire"
        assert "moe_block" in out and "expert parallelism" in out, "no moe_block miss shown"
    else:
        assert "MoeBlock[0, 1, 2, 3, 4]" in out, "the fused MoE block did not fire"
    assert "backend chosen by the plan: reference" in out  # CPU data runs the reference
    m = re.search(r"first/last \d+: ([\d.e+-]+) -> ([\d.e+-]+)", out)
    assert m, out
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.9 * first, (first, last)
    assert re.search(r"te_seq vs per-expert loop: max abs diff", out)


def _check_custom_fusion(out: str) -> None:
    for fused in ("ScaleShiftSquare[0, 1]", "SquareScaleShiftForward[1, 2]",
                  "SquareScaleShiftBackward[3, 4]"):
        assert fused in out, f"{fused} missing from the printed plans"
    assert "scale_shift_square[0, 1]: ScaleShiftSquare is written for float32/bf16" in out
    assert "ValueError: register_fusion: a fusion named 'scale_shift_square'" in out
    assert out.count("-> OK") == 5 and "MISMATCH" not in out
    assert "all checks passed" in out


def _check_hf_moe_finetune(out: str) -> None:
    if "transformers is not installed" in out:
        return  # the [hf] extra is absent: the example says so and exits 0
    assert "swapped 2 MoE blocks" in out and "restored 2 MoE blocks" in out, out
    assert re.search(r"te_seq experts: .* ms/step, loss [\d.]+ -> [\d.]+", out), out


CHECKS = {"moe_train.py": _check_moe_train, "custom_fusion.py": _check_custom_fusion,
          "hf_moe_finetune.py": _check_hf_moe_finetune}


@pytest.mark.slow
def test_moe_train_fails_when_the_loss_does_not_fall():
    # lr=0 keeps the weights fixed, so the loss cannot fall: the example must say so and exit 1.
    proc = run_example(ROOT / "examples" / "moe_train.py",
                       ["--steps", "12", "--device", "cpu", "--lr", "0"])
    assert proc.returncode == 1, _describe(proc)
    assert "loss did not fall" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["block", "rowwise", "tensor"])
def test_moe_train_fp8_loss_within_margin(fp8):
    # hidden 128: Float8BlockScaling's 128x128 weight blocks; the example states the margin.
    proc = run_example(ROOT / "examples" / "moe_train.py",
                       ["--steps", "30", "--device", "cpu", "--dtype", "float32",
                        "--hidden", "128", "--fp8", fp8])
    assert proc.returncode == 0, _describe(proc)
    assert "fp8 loss within the margin" in proc.stdout
    name = {"block": "Float8BlockScaling", "rowwise": "Float8RowwiseScaling",
            "tensor": "Float8CurrentScaling"}[fp8]
    assert f"GroupedMLP[1, 2, 3] [reference] fp8={name}" in proc.stdout


@pytest.mark.slow
def test_moe_train_fp8_with_the_wgrad_in_high_precision():
    proc = run_example(ROOT / "examples" / "moe_train.py",
                       ["--steps", "30", "--device", "cpu", "--dtype", "float32",
                        "--fp8", "rowwise", "--fp8-hp-wgrad"])
    assert proc.returncode == 0, _describe(proc)
    assert "fp8 loss within the margin" in proc.stdout
    assert "fp8=Float8RowwiseScaling(fp8_wgrad=False)" in proc.stdout
    bad = run_example(ROOT / "examples" / "moe_train.py", ["--fp8-hp-wgrad"])
    assert bad.returncode != 0 and "--fp8-hp-wgrad needs --fp8" in bad.stderr


@pytest.mark.slow
def test_moe_train_fp8_block_rejects_sizes_off_the_block():
    proc = run_example(ROOT / "examples" / "moe_train.py", ["--fp8", "block", "--hidden", "64"])
    assert proc.returncode == 2 and "multiples of 128" in proc.stderr, _describe(proc)


def readme_command(marker: str) -> str:
    """The first line of the ```bash block that follows `marker` in README.md."""
    text = (ROOT / "README.md").read_text()
    m = re.search(re.escape(marker) + r".*?```bash\n(.+?)\n", text, re.S)
    assert m, f"README.md has no bash block after {marker!r}"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = readme_command("<!-- test-command")
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f".ci/run does not run the README's test command {command!r}"
    assert os.access(ROOT / ".ci" / "run", os.X_OK), ".ci/run is not executable"


def test_readme_main_command_runs_the_main_example():
    command = readme_command("**Install and run the main example**")
    assert command.endswith("python3 examples/moe_train.py"), command


def test_readme_quickstart_runs(capsys):
    text = (ROOT / "README.md").read_text()
    m = re.search(r"## Quickstart\s+```python\n(.+?)\n```", text, re.S)
    assert m, "README.md has no Quickstart python block"
    exec(compile(m.group(1), "README.md quickstart", "exec"), {})  # noqa: S102
    assert "GroupedMLP[0, 1, 2]" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_moe_train_expert_parallel_under_torchrun(fp8):
    # --ep 2: two CPU processes (gloo) started by torchrun, each holding 4 of the 8 experts;
    # with --fp8 the same processes train a second time under the recipe.
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/moe_train.py", "--ep", "2", "--device", "cpu", "--steps", "40",
         "--dtype", "float32", *(["--fp8", fp8] if fp8 else [])],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep +
                       os.environ.get("PYTHONPATH", "")},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, _describe(proc)
    assert "expert parallel: 2 ranks (gloo), 4 of 8 experts per rank" in proc.stdout
    _check_moe_train(proc.stdout, expert_parallel=True)
    if fp8:
        assert "fp8=Float8RowwiseScaling" in proc.stdout and "fp8 loss within the margin" in \
            proc.stdout, proc.stdout[-2000:]
