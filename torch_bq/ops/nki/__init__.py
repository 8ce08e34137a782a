"""NKI kernels for Trainium2 and their registration on the ``neuron`` device.

Layout: :mod:`.launch` (argument checks and layout, plain torch), :mod:`.qdq`
(activation round trip), :mod:`.decode` (fp8/fp4 weight decode),
:mod:`.linear` (the GEMMs), :mod:`.register` (``neuron`` kernels for the
``torch_bq::`` ops when :func:`torch_bq.ops._backend.neuron_available`).

Only :mod:`.launch` and :mod:`.register` are imported with torch_bq; the
kernel modules import ``nki`` and are loaded only on a machine that has it
(or by the tests, through the stand-in). See docs/nki.md.
"""
