"""A sweep worker process: ``python -m falcon_lab.sweeps.worker CONTEXT.json INDEX``.

Started by ``python -m falcon_lab.sweep ... workers=N`` (one per GPU); it runs the ask -> train ->
tell loop of :func:`falcon_lab.sweeps.driver.worker_loop` against the shared study.
"""
import sys

from falcon_lab.sweeps.driver import main_worker

if __name__ == "__main__":
    sys.exit(main_worker())
