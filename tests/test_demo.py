"""`drafter-demo` end to end, short: the sidecar as a child process, the engine, the report, SIGTERM at the end."""
import importlib.util

from drafter_client.engine.demo import main


def test_demo_runs_and_stops_the_sidecar(tmp_path, capsys):
    chart = tmp_path / "acceptance.png"
    assert main(["--max-new-tokens", "8", "--device", "cpu", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "sidecar SERVING at unix:" in out
    assert "mean acceptance length: " in out and "per-position acceptance: 1: " in out
    assert "speculative output identical to plain greedy decoding: yes" in out
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
