"""The one set of defaults of the method options, for every command (eval, train-adapters, diagnose,
oscar-artifact), the library functions and the runtime cache; `kvcalib.methods.MethodSettings`
says how a given option, an artifact's setting and these combine. No torch here: the CLI reads it."""

DEFAULTS = {"bits": 2, "group_size": 32, "residual": 128, "scaling": "l2", "rotation": True, "sink_tokens": 0,
            "residual_mode": "blockwise", "keys": "kivi", "sliding_layers": "float16"}
OPTIONS = {"bits": "--bits", "group_size": "--group-size", "residual": "--residual", "scaling": "--scaling",
           "rotation": "--rotation/--no-rotation", "sink_tokens": "--sink-tokens",
           "residual_mode": "--residual-mode", "keys": "--keys", "sliding_layers": "--sliding-layers"}
KVLINC_KEYS = ("kivi", "oscar")  # --keys: the key coding KVLinC's correction is trained on top of (kvcalib.methods.kvlinc)
RESIDUAL_MODES = ("blockwise", "sliding")  # --residual-mode: `kvcalib.methods.base` says what each does
# --sliding-layers: a layer that slides over a window (Gemma 2 and 3) keeps its window as the model computes it, as
# transformers' own caches do (float16), or is compressed like a full-attention layer (compress)
SLIDING_LAYERS = ("float16", "compress")
KMEANS = ("auto", "faiss", "torch")  # --kmeans: `kvcalib.methods.vecinfer_fit.kmeans_library` says which each takes
# kvcalib plan: the schemes each layer's keys and values may take (`kvcalib.methods.plan`), and the one
# whose KL divergence is measured per item (`kvcalib.methods.plan_fit`)
# (the vector schemes fit k-means codebooks with faiss: `pip install kvcalib[cpu]`)
# --dtype of every command that loads a model: auto takes the checkpoint's own on a GPU (`models.default_dtype`)
DTYPE_CHOICES = ("auto", "float16", "bfloat16", "float32")
PLAN_CANDIDATES = ("turboquant-1", "turboquant-2", "turboquant-3", "turboquant-4", "turboquant-d4b5", "turboquant-d4b6",
                   "turboquant-d4b7", "vecinfer-d4b6", "vecinfer-d4b7", "vecinfer-d4b8", "kivi-2-g128", "kivi-3-g128",
                   "kivi-4-g128", "oscar-2-g32", "oscar-2-g128", "oscar-3-g128", "oscar-4-g128")
PLAN_ANCHOR = "turboquant-2"
# Keys take only the scalar candidates (no vector codebook) unless --key-candidates says otherwise: at 2.25 bits the
# plan whose keys could take vector codes miscopied RULER's needle at 4k (87 of 100 against fp16's 99); without
# vector codes on keys its perplexity is no worse (16.488 against 16.512) and the needles come back, 98 of 100
# (benchmarks/RESULTS.md, "Offline RULER at 4k and 8k, 100 samples a task"; the earlier plans in its history).
PLAN_VECTOR_KEYS = False
PLAN_ITEMS = ("layer", "head")  # what the plan chooses a scheme for: each layer's keys and values, or each KV head's
# The plan's defaults are the best plan measured (benchmarks/RESULTS.md, "Plans with vector codebooks"): a scheme
# per KV head, the first token of each sequence kept in float16 (a sink the rest of the sequence attends to)
PLAN_ITEM = "head"
PLAN_SINK_TOKENS = 1
