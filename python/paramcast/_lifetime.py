"""Stops every live Subscriber and Publisher when the interpreter exits.

ParamCast's threads call back into Python; they must be stopped while the
interpreter still runs, not during its finalization. Subscribers first:
they leave, then publishers close.
"""

import atexit
import weakref

_live = weakref.WeakSet()


def track(obj):
    _live.add(obj)


@atexit.register
def _close_all():
    objects = list(_live)
    for obj in sorted(objects, key=lambda o: o._exit_order):
        try:
            obj.close()
        except Exception:  # noqa: BLE001: nothing can be done at exit; the others still close
            pass
