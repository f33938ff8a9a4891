"""`drafter-demo` end to end, short: the sidecar as a child process, the engine, the report, SIGTERM at the end."""
import importlib.util
import json

from drafter_client.engine.demo import main


def test_demo_runs_and_stops_the_sidecar(tmp_path, capsys):
    chart = tmp_path / "acceptance.png"
    assert main(["--max-new-tokens", "8", "--device", "cpu", "--chart", str(chart), "--json", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    assert "sidecar SERVING at unix:" in out
    assert "mean acceptance length: " in out and "per-position acceptance: 1: " in out
    assert "speculative output identical to plain greedy decoding: yes (every run of the 5 rounds)" in out
    # five timed rounds, speculative and plain alternated; the speedup printed is the middle round's
    lines = [x for x in out.splitlines() if x.startswith("round ")]
    assert [x.split(" (")[0] for x in lines] == [f"round {i}/5" for i in range(1, 6)], lines
    assert [("speculative first" in x) for x in lines] == [True, False, True, False, True], lines
    speedups = sorted(float(x.rsplit(" ", 1)[1].rstrip("x")) for x in lines)
    line = next(x for x in out.splitlines() if x.startswith("speedup: "))
    assert line.startswith(f"speedup: {speedups[2]:.2f}x (median of 5 alternated rounds: "), (line, speedups)
    # --json: the same figures, for scripts/batch_scale_targets.py --demo
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["benchmark"] == "drafter_demo" and run["device"].startswith("cpu") and run["date"] and run["command"]
    assert [r["speculative_first"] for r in run["rounds"]] == [True, False, True, False, True]
    assert [f"{r['speedup']:.2f}" for r in run["rounds"]] == [x.rsplit(" ", 1)[1].rstrip("x") for x in lines]
    assert f"{run['speedup']:.2f}" == f"{speedups[2]:.2f}" and run["identical_to_plain"] is True
    assert run["head"] == "eagle3" and run["k"] == 3 and run["max_new_tokens"] == 8 and run["step_channel"] is True
    assert "sidecar stopped with SIGTERM, exit code 0" in out
    # the steps go where the header says: through the step channel, none by gRPC (warm-up and timed runs)
    assert "steps through a shared-memory step channel" in out
    line = next(x for x in out.splitlines() if x.startswith("drafter steps: "))
    assert int(line.split()[2]) > 0 and line.endswith(", 0 by unary gRPC"), line
    if importlib.util.find_spec("matplotlib"):
        assert chart.stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in out and not chart.exists()


def test_demo_reports_a_sidecar_that_cannot_start(tmp_path, capsys):
    models = tmp_path / "models"
    (models / "target").mkdir(parents=True)
    (models / "eagle3").mkdir()
    (models / "target" / "config.json").write_text("{}")
    (models / "eagle3" / "config.json").write_text("{}")
    assert main(["--models", str(models), "--device", "cpu", "--chart", ""]) == 1
    captured = capsys.readouterr()
    assert "the sidecar exited with code 1 before serving" in captured.err


def test_demo_passes_sidecar_flags_to_the_sidecar(tmp_path, capsys):
    """--sidecar-flag: an extra drafter-serve flag on the sidecar's command line (printed as it starts), recorded in
    the JSON; a flag drafter-serve refuses stops the sidecar before it serves, and the demo says so."""
    assert main(["--max-new-tokens", "4", "--rounds", "1", "--device", "cpu", "--chart", "",
                 "--sidecar-flag=--step-channel-rehearse-after-s=0", "--json", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    start = next(x for x in out.splitlines() if x.startswith("starting the sidecar: "))
    assert start.endswith(" --step-channel-rehearse-after-s=0"), start
    assert json.loads((tmp_path / "run.json").read_text())["sidecar_flags"] == ["--step-channel-rehearse-after-s=0"]
    assert main(["--rounds", "1", "--device", "cpu", "--chart", "", "--sidecar-flag=--no-such-flag"]) == 1
    assert "before serving" in capsys.readouterr().err


def test_demo_refuses_zero_rounds(capsys):
    assert main(["--rounds", "0", "--device", "cpu", "--chart", ""]) == 2
    assert "--rounds must be 1 or more" in capsys.readouterr().err
