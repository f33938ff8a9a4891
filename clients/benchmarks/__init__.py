"""Benchmark scripts (client side): bench_step, acceptance, and the plots of their JSON.

May import drafter_client, drafter_client.engine and drafter_service (bench_step runs the proposer in-process in
the same run as the sidecar, to compare them); matplotlib only for the plots."""
import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[demo]'): no plot", file=sys.stderr)
        return None
    return plt
