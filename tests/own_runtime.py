"""A runtime of the tests' own: the cpu runtime under another name.

What adding a runtime takes: this one module, with a ``RUNTIME`` description named as the module
(``scaling.runtime=tests.own_runtime``); nothing else of raytpu changes.
"""

from __future__ import annotations

from raytpu.runtime.builtin import CPU


class OwnRuntime(CPU):
    name = "tests.own_runtime"
    words = "the cpu runtime under the tests' own name"


RUNTIME = OwnRuntime()
