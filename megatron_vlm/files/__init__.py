"""Files every part writes or reads, local or in an object store (no torch, no megatron-core):

- :mod:`.atomic`  outputs written to a temporary path and renamed at the end, durably (fsync);
- :mod:`.storage` local paths and ``msc://`` object-store URLs (multi-storage-client) behind one small API.
"""
