"""Deployment tooling: what starts, places, supervises and tests a cluster; none of it runs inside a service.

    launch      the helpers ``deploy/start_cluster.sh`` calls (``plan``, ``wait-health``)
    placement   hostfile parsing and the placement of engines and learner ranks on hosts and GPUs
    scale       ``async-vapo plan``: memory and weight-sync sizes of a config on a cluster
    supervise   one supervisord per host: its config, its status
    crashloop   the supervisord event listener: restart backoff and the crash-loop limit
    faults      crash injection into a running cluster and the audit of what the run kept

The services themselves are ``async_vapo.services``.
"""
