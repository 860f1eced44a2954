"""The ZeRO configurations the engine-lifecycle tests run at."""

#: (stage, extra zero_optimization keys) - offload takes the hooked paths
VARIANTS = {
    "0": (0, {}),
    "1": (1, {}),
    "2": (2, {}),
    "2-offload": (2, {"offload_optimizer": {"device": "cpu"}}),
    "3": (3, {}),
    "3-offload": (3, {"offload_param": {"device": "cpu"}}),
}
