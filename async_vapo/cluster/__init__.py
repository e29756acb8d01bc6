"""The asynchronous cluster: four services (rollout, verifier, replay, learner) linked by ZeroMQ.

Data flow (each arrow one socket; the stable end binds)::

    rollout-i --PUSH--> verifier --PUSH--> replay <--DEALER/ROUTER-- learner
        ^  |                                                          |  ^
        |  +----------------- PUSH (WeightsAck, Heartbeat) -----------+  |
        +------------------- SUB <- XPUB (WeightsAnnounce, Heartbeat) ---+

Each service is ``services/<name>.py`` (argument parsing only) calling ``run_<name>`` here; the socket
table, timeouts and policies are in each module's docstring. ``deploy/start_cluster.sh`` starts them.
Nothing here is imported by the one-process trainer.
"""
