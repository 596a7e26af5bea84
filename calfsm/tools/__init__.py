"""The commands and runners: ``calfsm run``/``capabilities``/``soak``, the vendor and
direct runners, and the generators of the diagrams and error tables in docs/."""
