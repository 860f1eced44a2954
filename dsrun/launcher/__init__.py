"""The launcher side of dsrun: CLI, planning, backends and the node agent.

Nothing under this package imports torch: the launcher and the node agents
must start in milliseconds, and only rank processes need torch.
"""
