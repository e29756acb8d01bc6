"""The asynchronous cluster: four services (rollout, verifier, replay, learner) linked by ZeroMQ.

Data flow (each arrow one socket; the stable end binds)::

    rollout-i --PUSH--> verifier --PUSH--> replay <--DEALER/ROUTER-- learner
        ^  |                                                          |  ^
        |  +----------------- PUSH (WeightsAck, Heartbeat) -----------+  |
        +------------------- SUB <- XPUB (WeightsAnnounce, Heartbeat) ---+

Each service is ``services/<name>.py`` (argument parsing only) calling ``run_<name>`` of this package's
``rollout``, ``verifier``, ``replay`` or ``learner`` (``context``: what every service shares), which makes a ZeroMQ
transport and hands it to the service: every service takes its transport, so the same services run in one process
over ``transport.InprocTransport`` (tests/integration/test_pipeline.py). The socket table, timeouts and
policies are in each module's docstring. ``deploy/start_cluster.sh`` starts them, under one supervisord per host that
restarts a service that dies; that tooling (placement, supervision, crash-loop limit, fault injection) is
``async_vapo.deploy``, apart from the services it starts. The learner runs the
step loop of ``async_vapo.learner.loop``, as the one-process trainer does; weights move by
``async_vapo.weights``. Nothing here imports the trainer.
"""
