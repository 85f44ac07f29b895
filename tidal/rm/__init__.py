"""Reward-model training (``job: reward_model``): a one-label sequence classifier trained with the
Bradley-Terry loss on preference pairs, under the same Strategy, checkpoints and logging as RL, and
exported as a folder that an RL run loads as a ``type: model`` reward component.

Modules: ``config`` (``reward_model.*``), ``pairs`` (row conventions -> texts), ``dataset``
(pairs from the data layer), ``loss`` (Bradley-Terry, pairwise accuracy), ``model`` (loading,
the pair forward), ``trainer`` (the loop), ``setup`` (wiring), ``export``, ``task`` (the built-in
synthetic preference task), ``cli``. See docs/reward_model.md.
"""
