"""supervisord as the pool runs it: supervisord's own main, then, when the controller that
started it is dead, the weight segments that controller can no longer remove.

supervisord is the controller's child and ends when it dies (its pdeathsig SIGTERM), having
stopped every program. A controller killed outright (kill -9, the OOM killer) left the pool's
weights in /dev/shm, as much memory as the model, until a later start removed them (and none
may come: a pool run by hand, a container not restarted). Run after supervisord's programs
have ended, when nothing maps the segments any more; the publisher, killed with the
controller, leaves its half-written one, which names the same owner.
"""

from __future__ import annotations

import os


def main() -> None:
    # supervisord's package, not this project's `supervisor/` (mapped to mpspool.supervisor).
    from supervisor.supervisord import main as supervisord_main

    controller = os.getppid()
    supervisord_main()
    if os.getppid() != controller:  # the controller died: reparented
        # Imported only now: supervisord stays as small as it was while the pool runs.
        from mpspool import segment

        segment.remove_stale()


if __name__ == "__main__":
    main()
