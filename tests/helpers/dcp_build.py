"""A DCP `.metadata` built from either set of classes (DCP's own, or interop's stand-ins), to compare pickles."""
import torch


def build_metadata(m, info, layers: int = 3, experts: int = 4):
    """`m`: a module with DCP's metadata classes; `info`: its `_StorageInfo`.  Stacked experts (a chunk per layer
    and expert), a plain tensor, a byte object, as interop's torch_dist writer lays them out."""
    entries, storage, offset = {}, {}, 0
    size = torch.Size([layers, experts, 6, 4])
    chunks = []
    for layer in range(layers):
        for e in range(experts):
            at = torch.Size([layer, e, 0, 0])
            chunks.append(m.ChunkStorageMetadata(at, torch.Size([1, 1, 6, 4])))
            storage[m.MetadataIndex("experts.fc1", at)] = info(f"__{layer + 1}_0.distcp", offset, 48)
            offset += 48
    entries["experts.fc1"] = m.TensorStorageMetadata(m.TensorProperties(dtype=torch.bfloat16), size, chunks)
    entries["embedding"] = m.TensorStorageMetadata(m.TensorProperties(dtype=torch.float32), torch.Size([250, 4]),
                                                   [m.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([250, 4]))])
    storage[m.MetadataIndex("embedding", torch.Size([0, 0]))] = info("__0_0.distcp", 0, 4000)
    entries["obj/shard_0_1"] = m.BytesStorageMetadata()
    storage[m.MetadataIndex("obj/shard_0_1")] = info("__0_0.distcp", 4000, 9)
    return m.Metadata(state_dict_metadata=entries, storage_data=storage,
                      storage_meta=m.StorageMeta(checkpoint_id="/ckpt", save_id="id"), version="1.0.0")
