"""Names vulture cannot see used, reviewed one by one (``tests/unit/test_dead_code.py`` runs vulture
over ``tidal``, ``bench`` and ``examples`` with this file at ``--min-confidence 60``; it must report
nothing). Add a name here only with the reason it is alive."""

# ruff: noqa
# fmt: off
_ = object()

# Registered by name and built from the config (a decorator adds them to a Registry).
CPGD, GAE, DrGRPO, Reinforce, ReinforcePPBaseline, RLOO  # algorithm.advantage
TokenMean, SeqMeanTokenMean, SeqMeanTokenSum, ConstantNormalizer  # algorithm.loss_agg
K1, K2, K3  # algorithm.kl_estimator
CISPO, CPGDLoss, GMPO, GSPO, PPOClip  # algorithm.policy_loss
TorchOps, TritonOps  # engine.kernel_backend
ExactOps  # the native engine in exact mode (numerics.exact), registered by name
process_logits  # tidal.engine.sampler: the processed distribution from flat arguments (tests; unused in tidal since the filter merge)
Qwen3ForCausalLM, LlamaForCausalLM, Qwen2_5_VLForConditionalGeneration  # the HF config's model_type
JsonlBackend, TensorBoardBackend, WandbBackend, ConsoleBackend  # logging.backends
MathAnswer, ThinkAnswerFormat, LengthPenalty, ReasoningGymReward  # reward rule components

# Named in configs as "module:function" and imported at run time.
arithmetic_reward  # tidal/configs/quickstart.yaml
squares_reward  # examples/squares/config.yaml

# Public attributes of documented records and objects, read by users and tests.
dp_rank, dp_size  # Runtime: this rank's place in the orthogonal DP groups (spec §2.2)
_.tp_ranks  # Runtime: the ranks of this rank's TP group
component_masks  # RewardOutput: which component scored which sample
sft_accuracy  # TaskAssets: the warm start's held-out accuracy, printed by the task build
_.collectives  # BucketedFullTensors: collectives issued (weight-sync tests count them)
_.copies_to_host  # ModelParking: host copies made (a frozen model is copied once; tests count them)
_.host_bytes  # ModelParking, StreamedAdamW: host bytes held (tests check that they are sized exactly)
_.peak_staging_bytes  # StreamedAdamW: device bytes staged in its last step (tests check: two chunks)
_.predicted_peak_allocated_gib  # MemoryPlan: what benchmarks compare with torch.cuda.max_memory_allocated (tests check it)

# Set on objects of other libraries, which read them.
_.pad_token, _.truncation_side  # transformers tokenizers
_.normalizer, _.pre_tokenizer, _.decoder  # tokenizers.Tokenizer
_.__cuda_array_interface__  # read by torch.as_tensor (CUDA array interface)

# Dataclass fields read through dataclasses.fields().
greedy_reward, greedy_correct, sampled_reward, pass_at_k, greedy_length  # EvalSums
_.greedy_reward, _.greedy_correct, _.sampled_reward, _.pass_at_k, _.greedy_length
library_version  # tidal/tasks/reasoning_gym.py _Generation: hashed into the task store's folder name

# The observer hook of PhaseTimer: the benchmark registers its memory timeline and profiler through it.
_.add_observer, _.remove_observer

# Read by other libraries (bench/).
_._tree_built  # torch.autograd.profiler_util.EventList: its parent/child links are built already
_.on_train_begin, _.on_step_end, _.on_log, _.should_training_stop  # transformers.TrainerCallback / TrainerControl
CalculatorEnv, PythonToolEnv, SingleTurnEnv, McpEnv, OpenEnvEnv, VerifiersEnv  # env.name

__getattr__, __dir__  # tidal/rewards/__init__.py: module attributes loaded lazily (PEP 562)
_.read_metadata, _.load_bytes  # overrides of torch.distributed.checkpoint's FileSystemReader / LoadPlanner

# torch configuration flags, set by assignment (tidal/strategy/compile_cache.py).
_.fx_graph_cache, _.enable_autograd_cache

# Named in configs as "module:Class" (env.name) and imported at run time.
SyntheticToolEnv  # bench/multiturn.py's cases
_.metavar, _.help  # argparse actions: tidal launch names torchrun's positionals in its --help (tidal/launch.py)
_.base_lrs, _._last_lr  # torch's LRScheduler state, set after a resume (tidal/strategy/base.py apply_optim_settings)

# Public names re-exported by a package's lazy __init__ (tidal.lazy.lazy_exports names them as strings).
gather_and_generate  # tidal.distributed: the rollout entry point of the public API

# Overrides of pebble's pool manager, called by pebble's own threads (tidal/rewards/pool.py).
_.inspect_workers  # _WorkerManager: every worker that ended, exit code 0 included
_.live_pids  # WorkerPool: the live workers' pids (tests check a hung worker is replaced)
# tidal/families: the family interface's fields, read by the engine models and the memory plan of each family.
_.first_key, _.moe, _.text_prefix, _.experts, _.expert_intermediate, _.shared_experts, _.shared_intermediate
# Native engine models named by their family as engine_model "module:Class" (tidal/families/<name>.py).
Gemma3ForCausalLM, Olmo3ForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
_.__class__  # tidal/models/linear_attention.py gives HF's Gated DeltaNet layers their packed subclass in place
_.block_bytes  # ModelRunner: one KV block's bytes over the full layers (tests size a cache in blocks with it)
process_logits  # tidal.engine.sampler: the processed distribution's logprobs (docs/engine.md; speculative and vLLM tests compare with it)
_.kv_cache_bytes_per_token  # ModelShape: K and V bytes per token (the memory plan's tests check the families' caches with it)
_.turn_rewards_BT  # tidal/trainer/experience.py: Experience.row reads it by name (ROW_TOKEN_FIELDS)
_.render_body  # tidal/data/tokenizer_file.py: the {% generation %} block of a chat template, called by name by jinja2 (call_method)
