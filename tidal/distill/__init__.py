"""On-policy distillation: the teacher scores the tokens the student sampled (a local frozen model,
or a remote endpoint speaking :mod:`tidal.distill.protocol`); the signal is in
:meth:`tidal.algorithms.Algorithm.distill_advantage_BT`."""
