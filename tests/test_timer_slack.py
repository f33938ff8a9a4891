"""timer_slack.py: the slack is per thread (the step thread's 1 ns does not leak into other threads)."""
import sys
import threading

import pytest

from drafter_client.protocol.timer_slack import get_timer_slack, set_timer_slack

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_TIMERSLACK) is Linux")


def test_timer_slack_is_set_for_the_calling_thread_only():
    main_before = get_timer_slack()
    assert main_before is not None and main_before > 1
    seen = {}

    def other_thread():
        seen["before"] = get_timer_slack()
        seen["ok"] = set_timer_slack(1)
        seen["after"] = get_timer_slack()

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == {"before": main_before, "ok": True, "after": 1}
    assert get_timer_slack() == main_before
