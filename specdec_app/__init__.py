"""The ``specdec`` command (``python -m specdec_app``): the composition root that starts and drives
the services. The command line (cli.py), the local launcher and supervisor (launcher.py) with its
throwaway certificate authority (local_ca.py), and the benchmark (bench/), which starts every
service and drives the coordinator through its public client.

Dependencies point one way (tests/test_layering.py): the proto (``specdec.v1``), the core
(``specdec``), the services (``coordinator``, ``draft_service``, ``verify_service``), then this
package; nothing below imports it.
"""
