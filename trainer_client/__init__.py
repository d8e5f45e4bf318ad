"""Trainer-side companion of the rollout service, for megatron-core trainers.

The MTP loss and its gradient isolation, CP/TP padding, packing rollouts into
batches, Megatron <-> Hugging Face conversion, weight pushes into the service
(main model and MTP drafter) and the RL loop that ties them together. Imports
only ``rollout_service.protocol`` and ``rollout_service.client`` of the server.
"""
