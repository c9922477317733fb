"""The bounds of the values a user gives, in one place: the schema's fields and the CLI's flags
both take them from here.

Each is far beyond any real run and small enough that nothing downstream overflows, loops for
ever or hands a library a value it rejects with a traceback: a value past one is a typo, refused
with the field's name, not a plan.
"""

MAX_SEQ_LEN = 1 << 24  # tokens in one sample (16M; the longest published contexts are ~10M)
MAX_VOCAB = 1 << 24  # tokens in a vocabulary (uint32 ids; the largest published ~256K)
MAX_SEED = 2**32 - 1  # numpy's RandomState takes seeds in [0, 2^32)
MAX_NODES = 1 << 16
MAX_RANKS = 1 << 20  # devices in one run, all nodes together
MAX_RETRIES = 1000  # restarts of one run (each resumes from a checkpoint)
MAX_NEW_TOKENS = 100_000  # tokens `generate` writes for one prompt
MAX_GROUP_SIZE = 1024  # completions sampled per prompt in one RL step (published: 4 to 64)
MAX_UPDATES_PER_BATCH = 64  # optimizer updates on one RL batch (GRPO's μ; published: 1 to 4)
MAX_NAME = 128  # characters of a run name: a folder, a registry key and a rendezvous id
MAX_XID = 1 << 16  # an NVIDIA XID (the catalogue's are below 200: room for new ones, not for typos like -79)
# Optimization: an LR of 10 already diverges at once; decays past 10 shrink every weight to 0 in a step.
MAX_LEARNING_RATE = 10.0
MAX_WEIGHT_DECAY = 10.0
MAX_GRAD_CLIP = 1e6
MAX_ROPE_FACTOR = 1024.0  # context extension factor (published: 4 to 64)
MAX_BATCH_TOKENS = 1e9  # tokens (or samples) in one optimizer step (published: ~16M tokens)
MAX_PRICE_PER_HOUR = 1e6  # of one device, in any currency (an H100 hour is ~2-10)
