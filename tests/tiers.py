"""Which tier each test is in: the one table (tests/tiering.py applies it).

`pr` runs on every CI run and in a plain `pytest`: every feature, dtype and parallel layout at
least once. `slow` holds the rest: the full kernel grids, every transformers-parity variant, every
pool-size case, long fuzzing and floods, several processes, the examples, the benchmark and
GPU-script smoke runs, most programs compiled for an H100. Every CI run also runs one of the
slow tier's SHARDS shards (`.ci/run`: `--tier all --shard auto`, the next shard at each commit),
and `.ci/full` runs everything.

Each key is a test id or a prefix of ids: a module ("tests/test_x.py"), a directory
("tests/gpu_compile/"), a test function with all its cases ("tests/test_x.py::test_y") or one
case ("tests/test_x.py::test_y[case]"). The longest key that matches decides; a test no key
matches is `pr`. So a slow function keeps a representative case in `pr` with a longer key. The
reason says what the `pr` tier keeps of it.

The durations behind these choices are tests/durations.json (a full run on the 2-core CI machine);
regenerate them when tiers change (tests/tiering.py says how).
"""

# In a shard a module's few slow tests pay its whole setup (its engines and references): a shard
# of 1/10 ran 412 s against the 162 s its tests took in a full run, so shards are 1/20.
SHARDS = 20

SLOW, PR = "slow", "pr"

TIERS: dict[str, tuple[str, str]] = {
    # --- kernels: the full grids (interpret mode, CI stages 1 and 2) ---------------------------
    "tests/test_kernels.py::test_decode_matches_reference": (SLOW, "the grid of GQA ratios x head dims x dtypes"),
    "tests/test_kernels.py::test_decode_matches_reference[4-64-f32]": (PR, "GQA 4, f32"),
    "tests/test_kernels.py::test_decode_matches_reference[8-128-bf16]": (PR, "GQA 8, head dim 128, bf16"),
    "tests/test_kernels.py::test_ragged_matches_reference": (SLOW, "the grid of GQA ratios x head dims x dtypes"),
    "tests/test_kernels.py::test_ragged_matches_reference[1-64-bf16]": (PR, "GQA 1, bf16"),
    "tests/test_kernels.py::test_ragged_matches_reference[4-128-f32]": (PR, "GQA 4, head dim 128, f32"),
    "tests/test_kernels.py::test_float8_pools_match_reference": (SLOW, "both kernels x both fp8 formats x dtypes"),
    "tests/test_kernels.py::test_float8_pools_match_reference[decode-e4m3fn-q-bf16-float8]": (PR, "decode, e4m3"),
    "tests/test_kernels.py::test_float8_pools_match_reference[ragged-e5m2-q-f32-float32]": (PR, "ragged, e5m2"),
    "tests/test_kernels.py::test_ragged_tiles_override_matches_the_default[16-tokens-32-keys]": (
        SLOW,
        "the other tile override stays",
    ),
    "tests/test_kernels.py::test_mixed_step_on_both_kernels_matches_the_ragged_reference": (
        SLOW,
        "the grid of GQA ratios x dtypes x step shapes",
    ),
    "tests/test_kernels.py::test_mixed_step_on_both_kernels_matches_the_ragged_reference[decodes-first-4-bf16]": (
        PR,
        "decodes first, GQA 4, bf16",
    ),
    "tests/test_kernels.py::test_mixed_step_on_both_kernels_matches_the_ragged_reference[prefill-first-1-f32]": (
        PR,
        "no leading decodes, GQA 1, f32",
    ),
    "tests/test_reference_attention.py::test_ragged_matches_dense": (SLOW, "the grid of loops x GQA x dtypes"),
    "tests/test_reference_attention.py::test_ragged_matches_dense[cpu-4-float32-1e-05]": (PR, "CPU loop"),
    "tests/test_reference_attention.py::test_ragged_matches_dense[gpu-8-bfloat16-0.02]": (PR, "GPU loop, bf16"),
    "tests/test_reference_attention.py::test_float8_pools_match_dense[e5m2-float8]": (SLOW, "e4m3 stays"),
    "tests/test_reference_attention.py::test_float8_pools_match_dense[e5m2-float32]": (SLOW, "e4m3 stays"),
    "tests/test_group_quant_kernel.py::test_kernel_matches_float64_and_xla": (SLOW, "the grid of groups x lengths"),
    "tests/test_group_quant_kernel.py::test_kernel_matches_float64_and_xla[float32-4bit-int4-g32-t5]": (PR, "int4"),
    "tests/test_group_quant_kernel.py::test_kernel_matches_float64_and_xla[bfloat16-8bit-int8-g16-t200]": (
        PR,
        "int8, bf16, many rows",
    ),
    # --- programs compiled for an H100 (CI stage 2) --------------------------------------------
    "tests/gpu_compile/": (SLOW, "each compiles a model's programs for an H100 (15-28 s)"),
    "tests/test_long_context.py": (SLOW, "8K and 32K prompts through chunked prefill on a CPU (a minute or two each)"),
    "tests/gpu_compile/test_h100_programs.py::test_no_h100_sampler_waits_on_the_host[bfloat16]": (
        PR,
        "no host waits in the step programs",
    ),
    "tests/gpu_compile/test_h100_programs.py::test_no_h100_program_temporaries_grow_with_the_pool[bfloat16]": (
        PR,
        "the pool updated in place on a GPU",
    ),
    "tests/gpu_compile/test_pipeline_tick_h100.py::test_h100_tick_updates_the_pool_in_place_and_waits_on_nothing[decode]": (
        PR,
        "the pipeline tick",
    ),
    "tests/gpu_compile/test_h100_programs.py::test_engines_on_large_gpus_take_vllms_batch_limits[h100-server]": (
        PR,
        "vLLM's batch limits on a large GPU",
    ),
    # --- pool size: every program x dtype x path x split x layout -------------------------------
    "tests/test_pool_size.py::test_no_program_temporaries_grow_with_the_pool": (SLOW, "31 cases of 5-13 s"),
    "tests/test_pool_size.py::test_no_program_temporaries_grow_with_the_pool[bfloat16-pallas-1-device-kv-fp8]": (
        PR,
        "the kernels, bf16, fp8 KV",
    ),
    "tests/test_pool_size.py::test_bfloat16_pool_in_float32_holds_exact_bfloat16_values": (
        SLOW,
        "the storage rule itself stays (test_cpu_stores_bfloat16_pools_in_float32)",
    ),
    # --- transformers parity: 24 architecture variants x 3 checks -------------------------------
    "tests/test_hf_parity.py": (SLOW, "24 variants x (prompt logits, greedy, chunked prefill)"),
    **{
        f"tests/test_hf_parity.py::test_prompt_logits_match_transformers[{variant}]": (
            PR,
            "one per architecture feature",
        )
        for variant in (
            "llama_gqa4",
            "llama3_rope",
            "llama_tied",
            "mistral_tp",
            "qwen2_bias",
            "qwen3_qk_norm",
            "phi3_longrope",
            "gemma3",
            "mistral_window",
        )  # mixtral's tokens stay in test_moe, TP's in test_tensor_parallel, PP's in test_pipeline_parallel
    },
    "tests/test_hf_parity.py::test_greedy_continuations_match_transformers[llama_gqa4]": (PR, "greedy"),
    "tests/test_hf_parity.py::test_chunked_prefill_logits_match_transformers[llama_gqa4]": (PR, "chunked prefill"),
    # --- benchmark and GPU-script smoke runs (subprocesses, whole scripts) -----------------------
    "tests/test_benchmark_smoke.py": (SLOW, "whole benchmark scripts; the GPU run's refusal stays"),
    "tests/test_benchmark_smoke.py::test_gpu_run_refuses_without_a_gpu": (PR, "no GPU: a clear refusal"),
    "tests/test_benchmark_smoke.py::test_vllm_run_refuses_without_a_gpu": (PR, "no GPU: a clear refusal"),
    "tests/test_lora.py::test_tensor_parallel_adapters_equal_peft[2]": (SLOW, "4 devices (kv heads repeated) stay"),
    "tests/test_benchmark_smoke.py::test_the_one_gpu_entry_point_runs_each_suite_and_refuses_others": (
        PR,
        "the GPU entry point's dispatch (seconds)",
    ),
    **{
        f"tests/test_quantization_gpu_script.py::{test}": (SLOW, "checks of one smoke run of the whole GPU script")
        for test in (
            "test_smoke_runs_every_stage_and_step",
            "test_smoke_hlo_census_per_step_and_program",
            "test_smoke_kernels_and_engine_headlines",
        )
    },
    **{
        f"tests/test_speculative_gpu_script.py::{test}": (SLOW, "checks of one smoke run of the whole GPU script")
        for test in ("test_smoke_runs_every_stage", "test_smoke_results_and_headlines")
    },
    "tests/test_attention_sweep.py::test_sweep_smoke_writes_every_case_and_refuses_a_bad_config": (
        SLOW,
        "the whole sweep script",
    ),
    "tests/test_bench_offline.py::test_throughput_on_sharegpt_against_transformers": (
        SLOW,
        "transformers' own continuous batching as the peer",
    ),
    "tests/test_bench_serve.py": (SLOW, "a server and the benchmark client against it; the client's parts stay"),
    "tests/test_bench_extraction.py::test_a_constrained_configuration_end_to_end": (SLOW, "a whole benchmark run"),
    "tests/test_synthetic_tokenizer.py": (SLOW, "builds every preset's tokenizer and runs bench extraction"),
    "tests/test_examples.py::test_rl_grpo_example_trains_with_shared_weights": (SLOW, "trains for several steps"),
    "tests/test_examples.py::test_rl_grpo_example_trains_a_lora_adapter": (SLOW, "trains for several steps"),
    # --- speculative decoding ------------------------------------------------------------------
    "tests/test_speculative.py::test_sampled_tokens_follow_the_plain_distribution": (SLOW, "300 requests twice"),
    "tests/test_speculative.py::test_tensor_parallel_speculation_gives_the_unsharded_tokens": (
        SLOW,
        "speculation and TP each stay",
    ),
    "tests/test_speculative.py::test_seeded_sampling_and_logprobs_are_the_same_with_speculation": (
        SLOW,
        "greedy equality stays",
    ),
    "tests/test_speculative.py::test_draft_model_gives_plain_greedy_tokens[preempting]": (SLOW, "roomy stays"),
    "tests/test_speculative.py::test_greedy_speculation_gives_plain_greedy_tokens[preempting]": (
        SLOW,
        "roomy stays",
    ),
    "tests/test_speculative.py::test_prefix_hits_on_blocks_written_around_rejected_proposals_match_plain": (
        SLOW,
        "prefix hits under speculation stay in test_structured_outputs",
    ),
    # --- tensor, pipeline and expert parallelism --------------------------------------------------
    "tests/test_tensor_parallel.py::test_greedy_tokens_equal_transformers_for_every_size": (
        SLOW,
        "5 variants x 4 sizes",
    ),
    "tests/test_tensor_parallel.py::test_greedy_tokens_equal_transformers_for_every_size[llama_tp-2]": (PR, "TP 2"),
    "tests/test_tensor_parallel.py::test_greedy_tokens_equal_transformers_for_every_size[phi3_tp-2]": (
        PR,
        "Phi-3's fused tensors split over 2 devices",
    ),
    "tests/test_tensor_parallel.py::test_greedy_tokens_equal_transformers_for_every_size[gemma3_tp-2]": (
        PR,
        "Gemma 3's per-layer windows and extra norms over 2 devices",
    ),
    "tests/test_tensor_parallel.py::test_greedy_tokens_equal_transformers_for_every_size[mistral_tp-8]": (
        PR,
        "TP 8: more devices than KV heads",
    ),
    "tests/test_tensor_parallel.py::test_host_tier_swaps_per_device_shards_and_tokens_equal_transformers[4]": (
        SLOW,
        "TP 2 stays",
    ),
    "tests/test_tensor_parallel.py::test_checkpoints_load_straight_into_their_shards[4]": (SLOW, "TP 2 stays"),
    "tests/test_async_scheduling.py::test_async_equals_sync_under_tensor_parallelism": (
        SLOW,
        "async (fused windows, preemption, swaps) and TP stay apart",
    ),
    "tests/test_pipeline_parallel.py::test_greedy_tokens_and_prompt_logits_equal_transformers": (
        SLOW,
        "TP x PP shapes",
    ),
    "tests/test_pipeline_parallel.py::test_greedy_tokens_and_prompt_logits_equal_transformers[2-2]": (
        PR,
        "TP 2 x PP 2",
    ),
    "tests/test_pipeline_parallel.py::test_engine_at_two_stages_equals_transformers_through_preemption_and_prefix_hits": (
        SLOW,
        "PP's tokens stay (TP 2 x PP 2); preemption and prefix hits stay apart",
    ),
    "tests/test_pipeline_carry.py::test_ticks_give_one_pipelined_step_and_the_unsharded_model": (
        SLOW,
        "the pipelined engine's tokens stay (test_pipelined_engine, PP 2)",
    ),
    "tests/test_pipelined_engine.py::test_decoding_groups_keep_every_stage_busy_and_give_transformers_tokens[2-4]": (
        SLOW,
        "PP 2 stays",
    ),
    "tests/test_moe.py::test_engine_tokens_equal_transformers_unsharded_and_split": (
        SLOW,
        "mixtral unsharded stays; int4 experts (dense product) and experts over 2 devices (expert-parallel) stay",
    ),
    "tests/test_moe.py::test_engine_tokens_equal_transformers_unsharded_and_split[mixtral_moe-1-False-None]": (
        PR,
        "MoE against transformers",
    ),
    "tests/test_moe.py::test_quantized_experts_over_an_fp8_kv_pool_split_over_2_devices_give_the_one_device_tokens[ffn-split]": (
        SLOW,
        "expert-parallel stays",
    ),
    "tests/test_speculative.py::test_greedy_speculation_gives_plain_greedy_tokens[swapping]": (
        SLOW,
        "roomy stays; swaps stay (test_async_scheduling)",
    ),
    "tests/test_server.py::test_jaxpaged_serve_with_api_key": (
        SLOW,
        "`jaxpaged serve` processes stay in CI stage 3 (test_server_hardening), API keys in the app",
    ),
    "tests/test_examples.py::test_step_function_example_decodes_like_transformers": (
        SLOW,
        "the examples; the step API stays (test_training_loop)",
    ),
    "tests/test_llm_api.py::test_compilation_cache_dir_keeps_the_step_programs": (
        SLOW,
        "a fresh process; the compilation cache serves every test run",
    ),
    "tests/test_prompt_logprobs.py::test_prompt_logprobs_survive_preemption": (
        SLOW,
        "prompt logprobs stay; preemption stays apart",
    ),
    "tests/test_pipeline_carry.py::test_steady_state_every_stage_busy_with_its_own_group[2]": (
        SLOW,
        "every stage busy stays (test_pipelined_engine, PP 2)",
    ),
    "tests/test_structured_outputs.py::test_forced_tokens_give_the_plain_tokens_in_fewer_steps": (
        SLOW,
        "forced runs happen in every constrained pr test (test_every_output_obeys_its_constraint_with_prefix_hits)",
    ),
    "tests/test_quantization.py::test_converted_checkpoint_quantizes_in_its_shards": (
        SLOW,
        "quantizing at load stays (test_logits_stay_close_to_transformers), shards (test_fp8_checkpoint)",
    ),
    "tests/test_llm_api.py::test_dummy_weights_from_a_config_only_directory": (
        SLOW,
        "dummy weights stay (test_dummy_weights; a config-only directory in CI stage 3, test_cli_first_run)",
    ),
    "tests/test_async_scheduling.py::test_async_equals_sync_when_steps_switch_between_speculating_and_not": (
        SLOW,
        "async (fused windows, preemption, swaps) and speculation stay apart",
    ),
    "tests/test_bench_offline.py::test_latency_of_a_fixed_batch": (
        SLOW,
        "the bench commands' engine flags stay (test_bench_startup)",
    ),
    "tests/test_llm_api.py::test_three_quarter_token_buckets_give_the_tokens_of_the_powers": (
        SLOW,
        "the 3/4-point buckets stay (test_input_batch: the packer's buckets; test_prompt_logprobs: their chunks)",
    ),
    "tests/test_llm_api.py::test_skip_tokenizer_init_runs_token_ids_from_a_config_only_directory": (
        SLOW,
        "token ids without a tokenizer stay in CI stage 3 (test_cli_first_run)",
    ),
    "tests/test_engine_parity.py::test_small_pool_preempts_and_matches_transformers": (
        SLOW,
        "preemption stays (test_quantization's prefix-cache-preemption, test_async_scheduling's preempt-recompute)",
    ),
    "tests/test_multihost.py": (SLOW, "several processes (the issue's slow tier); the argument checks stay"),
    "tests/test_multihost.py::test_bad_multi_process_arguments_are_named": (PR, "no processes"),
    # --- quantization --------------------------------------------------------------------------
    "tests/test_quantization.py::test_tensor_parallel_fp8_gives_the_unsharded_tokens_with_scales_beside_their_weights": (
        SLOW,
        "TP int4 and fp8 checkpoints stay (test_group_quant, test_fp8_checkpoint)",
    ),
    "tests/test_quantization.py::test_demo_model_perplexity_stays_within_the_budget": (
        SLOW,
        "fp8 logits stay (test_logits_stay_close_to_transformers)",
    ),
    "tests/test_quantization.py::test_demo_model_int4_perplexity_stays_within_its_bound": (
        SLOW,
        "int4 tokens stay (test_group_quant)",
    ),
    "tests/test_quantization.py::test_engine_gives_the_reference_loops_tokens": (SLOW, "3 modes x 3 paths"),
    "tests/test_quantization.py::test_engine_gives_the_reference_loops_tokens[fp8-weights-fp8-kv-prefix-cache-preemption]": (
        PR,
        "fp8 weights and KV through preemption",
    ),
    "tests/test_quantization.py::test_engine_gives_the_reference_loops_tokens[int8-weights-fp8-kv-chunked-prefill]": (
        PR,
        "int8 weights, chunked prefill",
    ),
    "tests/test_quantization.py::test_engine_gives_the_reference_loops_tokens[fp8-kv-host-tier-swap]": (
        SLOW,
        "fp8 KV stays; the host tier's swaps stay (test_async_scheduling)",
    ),
    "tests/test_group_quant.py::test_tensor_parallel_int4_gives_the_unsharded_tokens_with_groups_beside_their_weights": (
        SLOW,
        "TP sizes x act order",
    ),
    "tests/test_group_quant.py::test_tensor_parallel_int4_gives_the_unsharded_tokens_with_groups_beside_their_weights[2-False]": (
        PR,
        "TP 2 (act order stays in test_a_desc_act_model...)",
    ),
    "tests/test_int4_checkpoint.py::test_logits_and_greedy_tokens_equal_the_dequantized_model[gptq_8bit_channel]": (
        SLOW,
        "awq, compressed and act-order gptq stay",
    ),
    "tests/test_training_loop.py::test_new_weights_give_a_fresh_engines_tokens[4-fp8]": (
        SLOW,
        "1-None stays",
    ),
    # --- engines through preemption, tiers, processes ----------------------------------------------
    "tests/test_engine_parity.py::test_other_configurations_give_the_same_tokens[large-pool]": (
        SLOW,
        "a large pool's programs stay (test_pool_size)",
    ),
    "tests/test_engine_parity.py::test_bfloat16_demo_model_gives_the_same_tokens_through_the_host_tier": (
        SLOW,
        "bf16 engines stay (test_tensor_parallel, test_bfloat16)",
    ),
    "tests/test_disk_tier.py::test_a_new_engine_process_reuses_prefixes_an_earlier_one_computed": (
        SLOW,
        "two engine processes; the disk tier's own tests stay",
    ),
    "tests/test_structured_outputs.py::test_valid_under_tensor_parallelism": (SLOW, "PP 2 with grammars stays"),
    "tests/test_prompt_logprobs.py::test_prompt_logprobs_and_logit_bias_agree_under_tensor_parallelism": (
        SLOW,
        "one device's prompt logprobs stay",
    ),
    "tests/test_moe.py::test_expert_parallel_over_8_devices_gives_the_one_device_tokens": (
        SLOW,
        "expert parallelism over 2 devices stays",
    ),
    "tests/test_moe.py::test_int4_experts_logits_and_tokens_equal_transformers_on_the_dequantized_weights": (
        SLOW,
        "int4 experts in the engine stay",
    ),
    "tests/test_moe.py::test_awq_gptq_and_compressed_experts_equal_transformers_on_their_dequantized_weights": (
        SLOW,
        "int4 experts in the engine stay; awq, gptq and compressed checkpoints stay (test_int4_checkpoint)",
    ),
    "tests/test_structured_outputs.py::test_grammar_speculation_gives_the_plain_tokens_under_preemption_and_prefix_hits": (
        SLOW,
        "grammars with speculation stay (test_constraint_speculation)",
    ),
    "tests/test_structured_outputs.py::test_overlapped_masks_equal_synchronous_steps[preempt]": (
        SLOW,
        "fused-default stays",
    ),
    "tests/test_structured_outputs.py::test_pipeline_parallelism_gives_the_same_constrained_outputs": (
        SLOW,
        "grammars on one device stay",
    ),
    "tests/test_speculative.py::test_tensor_parallel_draft_model_gives_the_unsharded_tokens": (
        SLOW,
        "a draft model and TP each stay",
    ),
    "tests/test_quantization.py::test_fp8_kv_cache_takes_a_checkpoints_kv_scales": (
        SLOW,
        "fp8 KV and fp8 checkpoints stay",
    ),
    "tests/test_tensor_parallel.py::test_bfloat16_demo_model_gives_the_same_text_split_over_four_devices": (
        SLOW,
        "bf16 and TP each stay",
    ),
    "tests/test_pipelined_engine.py::test_sampler_inputs_leave_with_their_micro_batch": (
        SLOW,
        "the carried pipeline's greedy tokens, aborts and chunks stay",
    ),
    "tests/test_training_loop.py::test_new_weights_give_a_fresh_engines_tokens[2-None]": (SLOW, "one device stays"),
    "tests/test_pipeline_parallel.py::test_quantized_weights_split_over_stages_give_the_unsplit_tokens": (
        SLOW,
        "stages and quantization each stay",
    ),
    "tests/test_engine_parity.py::test_other_configurations_give_the_same_tokens[no-prefix-cache]": (
        SLOW,
        "chunked prefill stays",
    ),
    "tests/test_engine_parity.py::test_host_tier_reloads_evicted_blocks_swaps_and_matches_transformers[no-prefix-cache]": (
        SLOW,
        "with the prefix cache stays",
    ),
    "tests/test_bench_startup.py::test_bench_startup_compiles_and_reports_every_program[scanned]": (
        SLOW,
        "unrolled stays",
    ),
    "tests/test_bench_startup.py::test_scanned_and_unrolled_layers_give_the_same_logits_and_pool[bfloat16]": (
        SLOW,
        "float32 stays",
    ),
    "tests/test_examples.py::test_make_step_input_runs_a_ragged_batch_like_transformers": (
        SLOW,
        "the step-function example stays",
    ),
    "tests/test_pipelined_engine.py::test_aborts_in_flight_and_mixed_requests_give_one_devices_outputs": (
        SLOW,
        "shares its two engines with the sampler-inputs test (~30 s to build)",
    ),
    "tests/test_scheduler.py::test_random_workloads_keep_invariants_and_finish": (
        SLOW,
        "100 random workloads; the block manager's random ones stay",
    ),
    "tests/test_speculative.py::test_stop_strings_max_tokens_and_streaming_match_plain": (
        SLOW,
        "stop strings and speculation each stay; the plain runs they compare with take ~10 s",
    ),
    "tests/test_speculative.py::test_draft_model_catches_up_after_plain_steps_prefix_hits_and_preemption": (
        SLOW,
        "the draft model's greedy tokens stay",
    ),
    "tests/test_speculative.py::test_draft_model_gives_plain_greedy_tokens[chunked]": (SLOW, "roomy stays"),
    "tests/test_moe.py::test_autoawq_qwen2_moe_keeps_its_float_projections_float": (SLOW, "awq experts stay"),
    "tests/test_tensor_parallel.py::test_per_device_bytes_shrink_and_match_jaxpaged_plan": (
        SLOW,
        "the split table and plan's counts stay (test_param_table)",
    ),
    "tests/test_tensor_parallel.py::test_dummy_weights_are_the_same_model_for_every_size": (
        SLOW,
        "dummy weights per split stay (test_dummy_weights)",
    ),
    "tests/test_training_loop.py::test_new_weights_give_a_fresh_engines_tokens[1-int4]": (
        SLOW,
        "new float weights stay",
    ),
    "tests/test_param_table.py::test_placed_arrays_are_where_the_table_says": (SLOW, "two placements stay"),
    "tests/test_param_table.py::test_placed_arrays_are_where_the_table_says[qwen2_moe-fp8-4]": (PR, "MoE, fp8"),
    "tests/test_param_table.py::test_placed_arrays_are_where_the_table_says[llama_attention_bias_tied-int8-8]": (
        PR,
        "int8 over 8 devices",
    ),
    "tests/test_int4_checkpoint.py::test_tensor_parallel_loads_the_checkpoint_into_its_shards_and_gives_its_tokens": (
        SLOW,
        "int4 over TP stays (test_group_quant)",
    ),
    "tests/test_bench_startup.py::test_unrolled_engines_hold_per_layer_arrays_and_give_the_scanned_tokens": (
        SLOW,
        "scanned and unrolled layers' equality stays",
    ),
    "tests/test_pipeline_carry.py::test_steady_state_every_stage_busy_with_its_own_group[4]": (SLOW, "PP 2 stays"),
    # --- the server: floods, fuzzing and SIGTERM drains (CI stage 3) -------------------------------
    "tests/test_server_fuzz.py": (SLOW, "~2,000 hostile requests"),
    "tests/test_server_hardening.py::test_admission_limits": (SLOW, "a flood of queued requests"),
    "tests/test_vllm_tools.py::test_a_replica_killed_under_load_loses_no_unstarted_request_and_rejoins": (
        SLOW,
        "two replicas started twice; the data-parallel replica killed in tests/test_data_parallel.py stays",
    ),
    "tests/test_server_hardening.py::test_huge_prompts_and_a_deep_queue": (SLOW, "2,000 queued requests"),
    "tests/test_server_hardening.py::test_second_sigterm_ends_the_drain_with_clean_shapes": (
        SLOW,
        "the first SIGTERM's drain stays",
    ),
    "tests/test_cli_first_run.py::test_seed_random_gives_fresh_samples_and_the_default_repeats": (
        SLOW,
        "four generate runs",
    ),  # --- the throughput model: replays of the committed GPU runs (the scheduler type-checked) -------
    "tests/test_plan_throughput.py::test_the_model_is_within_its_stated_error": (
        SLOW,
        "the other committed runs in process; batch-1 latency and serving at inf stay",
    ),
    "tests/test_plan_throughput.py::test_every_run_is_within_its_stated_error_in_a_plain_process": (
        SLOW,
        "every committed run, ShareGPT's 1,000 requests too (7 s, a subprocess); the pr cases stay",
    ),
    "tests/test_plan_throughput.py::test_the_model_is_within_its_stated_error[latency]": (PR, "batch-1 latency"),
    "tests/test_plan_throughput.py::test_the_model_is_within_its_stated_error[latency_sync]": (PR, "without async"),
    "tests/test_plan_throughput.py::test_the_model_is_within_its_stated_error[serve_inf]": (PR, "serving, saturated"),
    "tests/test_plan_throughput.py::test_plan_predicts_vllms_sharegpt_sample": (
        SLOW,
        "tokenizes ShareGPT; the other workloads' command lines stay",
    ),
}
