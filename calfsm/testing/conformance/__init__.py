"""The driver conformance suite: every rule of ``docs/driver-protocol.md``, checked on
every registered driver (:func:`calfsm.drivers.driver_names`), shipped with calfsm so a
driver or a vendor shim is checked against the installed package with one command::

    python -m pytest --pyargs calfsm.testing.conformance
    CALFSM_CALRT_LIB=/path/libshim.so python -m pytest --pyargs calfsm.testing.conformance -k calrt

Importable test modules (``test_*``), their fixtures (:mod:`.fixtures`, loaded by this
package's ``conftest.py``) and helpers (:mod:`.util`). Needs pytest (calfsm's ``dev``
extra); nothing else in calfsm imports this package.
"""
