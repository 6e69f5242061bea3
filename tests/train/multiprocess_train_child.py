"""One process of test_loop_multiprocess.py: the trainer across processes (gloo on CPU).

Run as ``JAX_NUM_CPU_DEVICES=4 python -m tests.train.multiprocess_train_child
PROCESS_ID NUM_PROCESSES PORT DATA_DIR WORKDIR DATA EXPERT``: every
process calls :func:`moejax.train.loop.train` on the same workdir with the
test's tiny config and ``parallel.data=DATA, parallel.expert=EXPERT`` over
the 2 x 4 global devices (the mesh's rows follow the processes: with
DATA=1, EXPERT=8 the expert axis spans both, with DATA=2, EXPERT=4 the data
axis does). Prints ``OK <pid>``.
"""

import os
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


def main(pid, nproc, port, data_dir, workdir, data, expert):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                             process_id=pid, initialization_timeout=120)
  try:
    import io  # pylint: disable=g-import-not-at-top
    from moejax.train import loop  # pylint: disable=g-import-not-at-top
    from tests.train import test_loop_multiprocess as T  # pylint: disable=g-import-not-at-top
    assert jax.process_count() == nproc and jax.device_count() == 8, jax.devices()
    cfg = T.config(data_dir, parallel__data=data, parallel__expert=expert)
    out = io.StringIO()
    loop.train(cfg, workdir, out=out)
    print(out.getvalue(), flush=True)
  except BaseException:
    # Printed before the shutdown barrier, which aborts the process when the
    # other process is stuck.
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  finally:
    jax.distributed.shutdown()
  print(f"OK {pid}", flush=True)


if __name__ == "__main__":
  a = sys.argv[1:]
  main(int(a[0]), int(a[1]), int(a[2]), a[3], a[4], int(a[5]), int(a[6]))
