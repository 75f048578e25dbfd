"""shuffledp operations: keys and device bundles, Flower process launchers, the local deployment, the simulation
runner behind ``shuffledp run``/``resume``, the auditor's tool and the ``shuffledp`` dispatcher."""
