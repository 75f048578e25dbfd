"""shuffledp: clients package — the LDP side of the system.

* :mod:`shuffledp.clients.noise` — ChaCha20 CSPRNG (keyed from ``os.urandom``) and the exact, integer-only discrete
  Laplace sampler.
* :mod:`shuffledp.clients.randomizer` — ``clip_l1`` and ``DiscreteLaplaceRandomizer``: eps0-LDP for ANY two inputs of a
  client (noise calibrated to the L1 diameter 2C of the clipped report, never to one record's 2C/m).
* :mod:`shuffledp.clients.mechanism` — one interface over the local mechanisms (``laplace``, ``duchi``,
  ``privunit2``): ``randomize`` / ``decode`` / ``report_length``; :mod:`shuffledp.clients.duchi` and
  :mod:`shuffledp.clients.privunit` are the L2 mechanisms, on :mod:`shuffledp.clients.coins` (exact coins) and
  :mod:`shuffledp.clients.sphere` (L2 clip, uniform directions); docs/mechanisms.md.
* :mod:`shuffledp.clients.report` — the fixed-length report payload (``encode_report`` / ``decode_report``).
* :mod:`shuffledp.clients.messages` — the Flower message schema (names, ``TrainConfig``, ``arrays_digest``).
* :mod:`shuffledp.clients.data`, :mod:`shuffledp.clients.models` — digits / MNIST (IDX), partitions, PyTorch models.
* :mod:`shuffledp.clients.settings` — what a client pins (``PinnedSettings``, ``pinned_from_configs``, the data
  settings) and ``check_pinned``: refusals decided before the data is touched.
* :mod:`shuffledp.clients.core` — ``make_envelope``: request (or an update computed elsewhere) -> sealed envelope,
  without Flower.
* :mod:`shuffledp.clients.mod` — ``shuffle_mod``: a Flower client mod that turns any ClientApp's train reply (its
  updated model) into one sealed eps0-LDP report.
* :mod:`shuffledp.clients.app` — the project's Flower ``ClientApp`` (``train.shuffled``): ``shuffle_mod`` around
  its own training function.
"""
