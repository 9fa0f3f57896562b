"""What works on a converted module: errors against float32 and autocast (:mod:`~ampfx.tools.compare`), the
search for the nodes a metric needs in float32 (:mod:`~ampfx.tools.tune`), overflow hunting
(:mod:`~ampfx.tools.debug`), cast and byte counting (:mod:`~ampfx.tools.measure`), precision sensitivity
(:mod:`~ampfx.tools.numerics`) and reference runs (:mod:`~ampfx.tools.reference`). The public ones are
re-exported by :mod:`ampfx`."""
