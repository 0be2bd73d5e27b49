"""The rank side of the engine: one rank's part of a distributed step.

The rest of ``fpipe/_runtime`` is "one step on any stage": the instruction set, the
interpreter, autodiff, values between stages; both faces run on it. This package is what a
rank adds around it when the stages live in several processes: the groups and messages
between ranks (``p2p``), the build's gather and the fingerprint ranks must agree on
(``gather``, ``agreement``), what a rank joins at build (``joined``), the lockstep driver
and its calls (``driver``, ``calls``, ``inputs``), what makes one rank's step the job's
(``results``, ``data_parallel``, ``tie_groups``), how a failure reaches every rank
(``faults``, ``teardown``) and what ``fpipe.saving`` needs (``intact``, ``entries``,
``metadata``, ``saved_groups``, ``saved_optimizer``, ``training_state``). Nothing here is
imported by the local engine; it imports from it.
"""
