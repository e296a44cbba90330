"""StepTurns: steps that reach a rank out of order run in order; a lost step fails its successor."""
from __future__ import annotations

import threading
import time

import pytest

from decode_worker.turns import StepTurns


def test_steps_run_in_seq_order_whatever_order_they_arrive_in():
    turns, ran = StepTurns(timeout_s=10), []

    def step(seq):
        with turns.turn(seq):
            ran.append(seq)
            time.sleep(0.01)

    threads = [threading.Thread(target=step, args=(seq,)) for seq in (3, 1, 2, 0)]
    for t in threads:
        t.start()
        time.sleep(0.02)  # each arrives before its predecessors
    for t in threads:
        t.join(5)
    assert ran == [0, 1, 2, 3]


def test_a_failed_step_lets_the_next_run_and_a_missing_one_times_out():
    turns = StepTurns(timeout_s=0.2)
    with pytest.raises(ValueError):
        with turns.turn(0):
            raise ValueError("engine failed")
    with turns.turn(1):
        pass
    with pytest.raises(RuntimeError, match="step 2 never came"):
        with turns.turn(3):
            pass
    with pytest.raises(RuntimeError, match="came twice"):
        with turns.turn(1):
            pass
