"""Participants' mistakes, made one at a time in copies of the solutions, for tests/test_check.py.

Each comes from how participants go wrong: the warnings of the TODOs, slides and docs, the
issues filed after trying the course, and the usual slips (a name not imported, a local rank
where the global one belongs, a collective called on one rank, a wrong argument order). Each
must be reported at its TODO. The correct variants (another way to write a right solution)
must pass.

    (step, file, what goes wrong, the TODO that must be flagged, [(old text, new text), ...])
"""

DDP = "train/to_distributed_training.py"
SBATCH = "to_distributed_training.sbatch"
FSDP = "train/fsdp_training.py"
TP = "train/tp_training.py"
PP = "train/pp_training.py"
PERF = "train/perf_training.py"
PERF_SBATCH = "perf_training.sbatch"
COLL = "train/collectives.py"
MEM = "train/memory_training.py"

MISTAKES = [
    # ---- DDP ---------------------------------------------------------------------------
    ("ddp", DDP, "DistributedEvalSampler not imported", 1,
     [("from utils.data import DistributedEvalSampler\n", "")]),
    ("ddp", DDP, "DDP imported without its alias", 1,
     [("from torch.nn.parallel import DistributedDataParallel as DDP",
       "from torch.nn.parallel import DistributedDataParallel")]),
    ("ddp", DDP, "DistributedSampler from the wrong module", 1,
     [("from torch.utils.data.distributed import DistributedSampler",
       "from torch.distributed import DistributedSampler")]),
    ("ddp", DDP, "rank and local_rank swapped", 2,
     [("local_rank, rank, device, world_size = setup(", "rank, local_rank, device, world_size = setup(")]),
    ("ddp", DDP, "world_size = 1 left after setup", 2,
     [("    local_rank, rank, device, world_size = setup(args.seed, args.device)\n",
       "    local_rank, rank, device, world_size = setup(args.seed, args.device)\n"
       "    world_size = 1\n")]),
    ("ddp", DDP, "world_size from LOCAL_WORLD_SIZE (1 on each of two nodes)", 2,
     [("import math\n", "import math\nimport os\n"),
      ("    local_rank, rank, device, world_size = setup(args.seed, args.device)\n",
       "    local_rank, rank, device, _ = setup(args.seed, args.device)\n"
       "    world_size = int(os.environ[\"LOCAL_WORLD_SIZE\"])\n")]),
    ("ddp", DDP, "setup's arguments swapped", 2,
     [("setup(args.seed, args.device)", "setup(args.device, args.seed)")]),
    ("ddp", DDP, "training sampler with the local rank", 3,
     [("DistributedSampler(train_ds, num_replicas=world_size, rank=rank,",
       "DistributedSampler(train_ds, num_replicas=world_size, rank=local_rank,")]),
    ("ddp", DDP, "training sampler without shuffling", 3,
     [("rank=rank,\n                                       shuffle=True,",
       "rank=rank,\n                                       shuffle=False,")]),
    ("ddp", DDP, "DistributedSampler for validation", 3,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)",
       "val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, "
       "shuffle=False)")]),
    ("ddp", DDP, "sampler made but not given to the training DataLoader", 4,
     [("sampler=train_sampler, drop_last=True", "shuffle=True, drop_last=True")]),
    ("ddp", DDP, "sampler and shuffle=True together", 4,
     [("sampler=train_sampler, drop_last=True", "sampler=train_sampler, shuffle=True, "
       "drop_last=True")]),
    ("ddp", DDP, "validation DataLoader without its sampler", 4,
     [("val_loader = DataLoader(val_ds, sampler=val_sampler, **loader_args)",
       "val_loader = DataLoader(val_ds, **loader_args)")]),
    ("ddp", DDP, "no DDP wrapper", 5,
     [('\n    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n',
       "\n")]),
    ("ddp", DDP, "device_ids on the CPU", 5,
     [('model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)',
       "model = DDP(model, device_ids=[local_rank])")]),
    ("ddp", DDP, "the loop trains the unwrapped model", 5,
     [('    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n',
       '    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n')]),
    ("ddp", DDP, "device_ids by the global rank (GPU 2 on a node of 2)", 5,
     [('model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)',
       'model = DDP(model, device_ids=[rank] if device.type == "cuda" else None)')]),
    ("ddp", DDP, "every process of a node on GPU 0", 5,
     [('model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)',
       'model = DDP(model, device_ids=[0] if torch.cuda.is_available() else None)')]),
    ("ddp", DDP, "no set_epoch", 6, [("        train_sampler.set_epoch(epoch)\n", "")]),
    ("ddp", DDP, "set_epoch(0)", 6,
     [("train_sampler.set_epoch(epoch)", "train_sampler.set_epoch(0)")]),
    ("ddp", DDP, "set_epoch on rank 0 only (the shards overlap from the second epoch)", 6,
     [("        train_sampler.set_epoch(epoch)",
       "        if rank == 0:\n            train_sampler.set_epoch(epoch)")]),
    ("ddp", DDP, "set_epoch on the validation sampler", 6,
     [("train_sampler.set_epoch(epoch)", "val_sampler.set_epoch(epoch)")]),
    ("ddp", DDP, "the logged loss is a sum over ranks", 7,
     [("step_loss = all_reduce_mean(loss.detach())", "step_loss = all_reduce_sum(loss.detach())")]),
    ("ddp", DDP, "the step line reports rank 0's own loss", 7,
     [('print0(f"epoch {epoch} {monitor.report(step, step_loss)}")',
       'print0(f"epoch {epoch} {monitor.report(step, loss.detach())}")')]),
    ("ddp", DDP, "no all-reduce in evaluate", 8,
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n", "")]),
    ("ddp", DDP, "only the loss sum reduced", 8,
     [("loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)",
       "loss_sum = all_reduce_sum(loss_sum)")]),
    ("ddp", DDP, "the mean of the ranks' means", 8,
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n"
       "    model.train()\n    return (loss_sum / tokens).item()",
       "    model.train()\n    return all_reduce_mean(loss_sum / tokens).item()")]),
    ("ddp", DDP, "one print left", 9,
     [('    print0(f"epoch {epoch} train loss {train_loss:.4f}',
       '    print(f"epoch {epoch} train loss {train_loss:.4f}')]),
    ("ddp", DDP, "warn=print", 9, [("warn=print0,", "warn=print,")]),
    ("ddp", DDP, "printing on local rank 0", 9,
     [('    print0(f"test loss', '    if local_rank == 0:\n        print(f"test loss')]),
    ("ddp", DDP, "torch.save of the DDP model on every rank", 10,
     [('save0(model, out_dir / "final_model.pt")',
       'torch.save(model.state_dict(), out_dir / "final_model.pt")')]),
    ("ddp", DDP, "save0 of the DDP state dict", 10,
     [('save0(model, out_dir / "best_model.pt")', 'save0(model.state_dict(), out_dir / "best_model.pt")')]),
    ("ddp", DDP, "saving on local rank 0", 10,
     [('    save0(model, out_dir / "final_model.pt")',
       '    if local_rank == 0:\n        torch.save(model.module.state_dict(), out_dir / '
       '"final_model.pt")')]),
    ("ddp", DDP, "the sums over ranks thrown away (taken for in place)", 8,
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n",
       "    all_reduce_sum(loss_sum)\n    all_reduce_sum(tokens)\n")]),
    ("ddp", DDP, "validation on rank 0 only", 8,
     [("        val_loss = evaluate(model, val_loader, device)\n",
       "        if rank == 0:\n            val_loss = evaluate(model, val_loader, device)\n")]),
    ("ddp", DDP, "the logged loss averaged on rank 0 only, in its print", 7,
     [("            step_loss = all_reduce_mean(loss.detach())\n",
       "            step_loss = loss.detach().clone()\n"),
      ('                print0(f"epoch {epoch} {monitor.report(step, step_loss)}")\n',
       '                if rank == 0:\n                    print(f"epoch {epoch} '
       '{monitor.report(step, all_reduce_mean(step_loss))}")\n')]),
    ("ddp", DDP, "training sampler without drop_last", 3,
     [("shuffle=True, seed=args.seed, drop_last=True)", "shuffle=True, seed=args.seed)")]),
    ("ddp", DDP, "test sampler over the validation set", 3,
     [("test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)",
       "test_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)")]),
    ("ddp", DDP, "test DataLoader with the validation sampler", 4,
     [("test_loader = DataLoader(test_ds, sampler=test_sampler, **loader_args)",
       "test_loader = DataLoader(test_ds, sampler=val_sampler, **loader_args)")]),
    ("ddp", DDP, "test DataLoader without its sampler", 4,
     [("test_loader = DataLoader(test_ds, sampler=test_sampler, **loader_args)",
       "test_loader = DataLoader(test_ds, **loader_args)")]),
    ("ddp", DDP, "drop_last=True in loader_args (evaluation drops samples)", 4,
     [("    loader_args = dict(batch_size=args.batch_size,",
       "    loader_args = dict(batch_size=args.batch_size, drop_last=True,"),
      ("sampler=train_sampler, drop_last=True, **loader_args)", "sampler=train_sampler, **loader_args)")]),
    ("ddp", DDP, "every rank's sampler seeded with its rank (the shards overlap)", 3,
     [("shuffle=True, seed=args.seed, drop_last=True)",
       "shuffle=True, seed=args.seed + rank, drop_last=True)")]),
    ("ddp", DDP, "set_epoch at the end of the epoch (the first two epochs alike)", 6,
     [("        train_sampler.set_epoch(epoch)\n", ""),
      ("        if step == args.max_steps:\n            break\n\n    # ---- evaluation",
       "        train_sampler.set_epoch(epoch)\n"
       "        if step == args.max_steps:\n            break\n\n    # ---- evaluation")]),
    ("ddp", DDP, "set_epoch(step) in the batch loop", 6,
     [("        train_sampler.set_epoch(epoch)\n", ""),
      ("            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n",
       "            train_sampler.set_epoch(step)\n"
       "            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n")]),
    ("ddp", DDP, "no destroy_process_group", 11, [("    destroy_process_group()\n", "")]),
    ("ddp", DDP, "the DDP model kept alive past destroy_process_group", 11,
     [("    del model, optimizer\n", "")]),
    ("ddp", DDP, "destroy_process_group before the end", 11,
     [("    destroy_process_group()\n", ""),
      ("    write_summary(out_dir, summary, vocab=corpus.vocab)  # and vocab.txt (tools/generate.py)\n",
       "    write_summary(out_dir, summary, vocab=corpus.vocab)\n"
       "    if rank == 0:\n        destroy_process_group()\n")]),
    ("ddp", DDP, "the evaluation samplers given rank and world_size by position", 3,
     [("    val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)\n"
       "    test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)",
       "    val_sampler = DistributedEvalSampler(val_ds, rank, world_size)\n"
       "    test_sampler = DistributedEvalSampler(test_ds, rank, world_size)")]),
    ("ddp", DDP, "the averaged loss made a number with .item()", 7,
     [("step_loss = all_reduce_mean(loss.detach())",
       "step_loss = all_reduce_mean(loss.detach()).item()")]),
    ("ddp", DDP, "the process group destroyed right after the test evaluation", 11,
     [("    del model, optimizer\n    destroy_process_group()\n", "\n"),
      ("    test_loss = evaluate(model, test_loader, device)\n",
       "    test_loss = evaluate(model, test_loader, device)\n    destroy_process_group()\n")]),
    ("ddp", DDP, "set_epoch(epoch + 1)", 6,
     [("train_sampler.set_epoch(epoch)", "train_sampler.set_epoch(epoch + 1)")]),
    ("ddp", DDP, "the loss averaged for the step line only", 7,
     [("step_loss = all_reduce_mean(loss.detach())", "step_loss = loss.detach()"),
      ("monitor.report(step, step_loss)", "monitor.report(step, all_reduce_mean(step_loss))")]),
    ("ddp", DDP, "all_reduce_mean given world_size", 7,
     [("all_reduce_mean(loss.detach())", "all_reduce_mean(loss.detach(), world_size)")]),
    # ---- the DDP job file ---------------------------------------------------------------
    ("sbatch", SBATCH, "one GPU asked for", 12, [("#SBATCH --gres=gpu:4", "#SBATCH --gres=gpu:1")]),
    ("sbatch", SBATCH, "one GPU made visible", 12,
     [("export CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS", "export CUDA_VISIBLE_DEVICES=0")]),
    ("sbatch", SBATCH, "MASTER_ADDR from the last node", 13, [("| sed -n 1p)", "| tail -n 1)")]),
    ("sbatch", SBATCH, "head -n 1 under pipefail", 13, [("| sed -n 1p)", "| head -n 1)")]),
    ("sbatch", SBATCH, "the ethernet name, not the InfiniBand one", 13,
     [('nslookup "${MASTER_ADDR}${SITE_IB_SUFFIX}"', 'nslookup "${MASTER_ADDR}"')]),
    ("sbatch", SBATCH, "MASTER_ADDR not exported", 13, [("export MASTER_ADDR\n", "")]),
    ("sbatch", SBATCH, "a fixed port", 14, [("$((20000 + SLURM_JOB_ID % 10000))", "29500")]),
    ("sbatch", SBATCH, "MASTER_PORT not exported", 14,
     [("export MASTER_PORT=${MASTER_PORT:-", "MASTER_PORT=${MASTER_PORT:-")]),
    ("sbatch", SBATCH, "a misspelt variable under set -u", 14,
     [('echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"',
       'echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PRT"')]),
    ("sbatch", SBATCH, "no is_host", 15,
     [("    --rdzv_conf=is_host=$(( SLURM_NODEID == 0 ? 1 : 0 )) \\\n", "")]),
    ("sbatch", SBATCH, "one process per node", 15,
     [('--nproc_per_node="$NPROC_PER_NODE"', "--nproc_per_node=1")]),
    ("sbatch", SBATCH, "four tasks per node", 15,
     [("#SBATCH --ntasks-per-node=1", "#SBATCH --ntasks-per-node=4")]),
    ("sbatch", SBATCH, "a fixed rendezvous id", 15,
     [('--rdzv_id="$SLURM_JOB_ID"', "--rdzv_id=course")]),
    ("sbatch", SBATCH, "--nnodes=1", 15, [('--nnodes="$SLURM_JOB_NUM_NODES"', "--nnodes=1")]),
    ("sbatch", SBATCH, "the port is 20000 + the whole job id", 14,
     [("$((20000 + SLURM_JOB_ID % 10000))", "$((20000 + SLURM_JOB_ID))")]),
    ("sbatch", SBATCH, "the endpoint without the port", 14,
     [('--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"', '--rdzv_endpoint="$MASTER_ADDR"')]),
    ("sbatch", SBATCH, "bash -c's $0 left out (the script taken as $0)", 15,
     [("\"$@\"' torchrun \"$SCRIPT\"", "\"$@\"' \"$SCRIPT\"")]),
    ("sbatch", SBATCH, "srun without --cpus-per-task", 15,
     [('srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash',
       "srun --kill-on-bad-exit=1 bash")]),
    ("sbatch", SBATCH, "--nproc_per_node=4 written out", 15,
     [('--nproc_per_node="$NPROC_PER_NODE"', "--nproc_per_node=4")]),
    ("sbatch", SBATCH, "one node", 16, [("#SBATCH --nodes=2", "#SBATCH --nodes=1")]),
    ("sbatch", SBATCH, "four nodes", 16, [("#SBATCH --nodes=2", "#SBATCH --nodes=4")]),
    ("sbatch", SBATCH, "#SBATCH --gres after the first command", 12,
     [("#SBATCH --gres=gpu:4\n", "\n"),
      ("export CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS",
       "#SBATCH --gres=gpu:4\nexport CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS")]),
    ("sbatch", SBATCH, "--nnodes=2 written out (one node waits for a second)", 15,
     [('--nnodes="$SLURM_JOB_NUM_NODES"', "--nnodes=2")]),
    ("sbatch", SBATCH, "--ntasks=1 for the whole job", 15,
     [("#SBATCH --ntasks-per-node=1", "#SBATCH --ntasks=1")]),
    ("sbatch", SBATCH, "every Address line of nslookup (the DNS server's too)", 13,
     [("awk '/^Address: / && !n++ {print $2}'", "awk '/Address/ {print $2}'")]),
    ("sbatch", SBATCH, "nslookup without || true (a node without an InfiniBand name)", 13,
     [(" {print $2}' || true)", " {print $2}')")]),
    ("sbatch", SBATCH, "a MASTER_PORT set before the job replaced", 14,
     [("export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}",
       "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))")]),
    ("sbatch", SBATCH, "CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS before the site profile is sourced", 12,
     [("export CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS\n", ""),
      ("set -euo pipefail\n", "set -euo pipefail\nexport CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS\n")]),
    ("sbatch", SBATCH, "the port the job id modulo 65536 (below 1024 for some ids)", 14,
     [("$((20000 + SLURM_JOB_ID % 10000))", "$((SLURM_JOB_ID % 65536))")]),
    ("sbatch", SBATCH, "the port 20000 + the job id modulo 50000 (above 65535 for some ids)", 14,
     [("$((20000 + SLURM_JOB_ID % 10000))", "$((20000 + SLURM_JOB_ID % 50000))")]),
    ("sbatch", SBATCH, "the endpoint's port written out (MASTER_PORT unused)", 14,
     [('--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"', '--rdzv_endpoint="$MASTER_ADDR:29500"')]),
    ("sbatch", SBATCH, "the script and its arguments inside bash -c's single quotes", 15,
     [("""    "$@"' torchrun "$SCRIPT" "${ARGS[@]}"\n""", """    "$SCRIPT" "${ARGS[@]}"'\n""")]),
    ("sbatch", SBATCH, "a static rendezvous (--node_rank, --master_addr) for c10d", 15,
     [('    --rdzv_backend=c10d --rdzv_id="$SLURM_JOB_ID" \\\n'
       '    --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \\\n'
       '    --rdzv_conf=is_host=$(( SLURM_NODEID == 0 ? 1 : 0 )) \\\n',
       '    --node_rank="$SLURM_NODEID" \\\n'
       '    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \\\n')]),
    # ---- FSDP --------------------------------------------------------------------------
    ("fsdp", FSDP, "fully_shard not imported", 17,
     [("from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard",
       "from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy")]),
    ("fsdp", FSDP, "load_sharded_model not imported", 17,
     [("from utils.checkpointing import (load_sharded_model, resume_checkpoint,",
       "from utils.checkpointing import (resume_checkpoint,")]),
    ("fsdp", FSDP, "fully_shard on the root only", 18,
     [("    for block in model.layers.values():\n"
       "        fully_shard(block, reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n", "")]),
    ("fsdp", FSDP, "the ModuleDict of blocks sharded as one", 18,
     [("    for block in model.layers.values():\n"
       "        fully_shard(block, reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n",
       "    fully_shard(model.layers, reshard_after_forward=reshard_after_forward,\n"
       "                mp_policy=MixedPrecisionPolicy(**policy))\n")]),
    ("fsdp", FSDP, "the blocks but not the root", 18,
     [("    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n",
       "")]),
    ("fsdp", FSDP, "reshard_after_forward not passed on", 18,
     [("        fully_shard(block, reshard_after_forward=reshard_after_forward,\n",
       "        fully_shard(block,\n")]),
    ("fsdp", FSDP, "bf16 parameters always", 18,
     [("    policy = {}\n", "    policy = dict(param_dtype=torch.bfloat16)\n")]),
    ("fsdp", FSDP, "the bf16 policy given to the root only (the blocks gather fp32)", 18,
     [("        fully_shard(block, reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n",
       "        fully_shard(block, reshard_after_forward=reshard_after_forward)\n")]),
    ("fsdp", FSDP, "the root's logits left in bf16 (no output_dtype)", 18,
     [("MixedPrecisionPolicy(**policy, output_dtype=torch.float32)",
       "MixedPrecisionPolicy(**policy)")]),
    ("fsdp", FSDP, "gradients summed in bf16 (no reduce_dtype)", 18,
     [("policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
       "policy = dict(param_dtype=torch.bfloat16)")]),
    ("fsdp", FSDP, "fp16 for bf16 in the policy (float16 gathered and summed)", 18,
     [("policy = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
       "policy = dict(param_dtype=torch.float16, reduce_dtype=torch.float16)")]),
    ("fsdp", FSDP, "each block's attention and MLP sharded instead of the block", 18,
     [("    for block in model.layers.values():\n        fully_shard(block, "
       "reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n",
       "    for block in model.layers.values():\n        for part in (block.attn, block.mlp):\n"
       "            fully_shard(part, reshard_after_forward=reshard_after_forward,\n"
       "                        mp_policy=MixedPrecisionPolicy(**policy))\n")]),
    ("fsdp", FSDP, "model.layers iterated (its names, not its blocks)", 18,
     [("    for block in model.layers.values():\n        fully_shard(block,",
       "    for block in model.layers:\n        fully_shard(block,")]),
    ("fsdp", FSDP, "the loss history saved as tensors", 20,
     [("loss_history=[loss.item() for loss in loss_history],", "loss_history=loss_history,")]),
    ("fsdp", FSDP, "no --reshard-after-forward option", 18,
     [('    parser.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",',
       '    parser.add_argument("--reshard-after-forward-unused", choices=["true", "false"], '
       'default="true",'),
      ('args.reshard_after_forward == "true"', "True")]),
    ("fsdp", FSDP, "the optimizer made before sharding", 19,
     [("    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,\n"
       "                                  fused=device.type == \"cuda\")  # one kernel for all parameters\n", ""),
      ('    model = apply_fsdp(model, args.precision, args.reshard_after_forward == "true")\n',
       "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, "
       "weight_decay=args.weight_decay)\n"
       '    model = apply_fsdp(model, args.precision, args.reshard_after_forward == "true")\n')]),
    ("fsdp", FSDP, "no reshard after evaluation", 19,
     [("    for unit in model.modules():\n        if isinstance(unit, FSDPModule):\n"
       "            unit.reshard()\n", "")]),
    ("fsdp", FSDP, "only the root resharded after evaluation", 19,  # reshard() is not recursive
     [("    for unit in model.modules():\n        if isinstance(unit, FSDPModule):\n"
       "            unit.reshard()\n", "    model.reshard()\n")]),
    ("fsdp", FSDP, "the option's string passed as the flag", 19,
     [('apply_fsdp(model, args.precision, args.reshard_after_forward == "true")',
       "apply_fsdp(model, args.precision, args.reshard_after_forward)")]),
    ("fsdp", FSDP, "checkpoints saved on rank 0 only", 20,
     [('        save_checkpoint("last", epoch, batches_done)\n        if step == args.max_steps:',
       '        if rank == 0:\n            save_checkpoint("last", epoch, batches_done)\n'
       "        if step == args.max_steps:")]),
    ("fsdp", FSDP, "no loss_history in train_state", 20,
     [("                           loss_history=[loss.item() for loss in loss_history],\n", ""),
      ('        loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]\n',
       "")]),
    ("fsdp", FSDP, "saved inside the step, before its batch is counted", 20,
     [("            step += 1\n            batches_done += 1\n",
       "            step += 1\n"
       "            if args.checkpoint_every and step % args.checkpoint_every == 0:\n"
       "                save_checkpoint(\"last\", epoch, batches_done)\n"
       "            batches_done += 1\n"),
      ("            if args.checkpoint_every and step % args.checkpoint_every == 0:\n"
       "                save_checkpoint(\"last\", epoch, batches_done)\n\n        throughput",
       "\n        throughput")]),
    ("fsdp", FSDP, "saved before step += 1", 20,
     [("            step += 1\n            batches_done += 1\n",
       "            batches_done += 1\n"
       "            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:\n"
       "                save_checkpoint(\"last\", epoch, batches_done)\n"
       "            step += 1\n"),
      ("            if args.checkpoint_every and step % args.checkpoint_every == 0:\n"
       "                save_checkpoint(\"last\", epoch, batches_done)\n\n        throughput",
       "\n        throughput")]),
    ("fsdp", FSDP, "the last checkpoint of an epoch saved as the next epoch's start", 20,
     [("        save_checkpoint(\"last\", epoch, batches_done)\n        if step == args.max_steps:",
       "        save_checkpoint(\"last\", epoch + 1, 0)\n        if step == args.max_steps:")]),
    ("fsdp", FSDP, "--checkpoint-every not honoured", 20,
     [("            if args.checkpoint_every and step % args.checkpoint_every == 0:\n"
       '                save_checkpoint("last", epoch, batches_done)\n', "")]),
    ("fsdp", FSDP, "the best model with save0", 20,
     [('            save_checkpoint("best", epoch, batches_done)',
       '            save0(model, out_dir / "best_model.pt")'),
      ("from utils.checkpointing import (load_sharded_model,",
       "from utils.distributed_utils import save0\nfrom utils.checkpointing import (load_sharded_model,")]),
    ("fsdp", FSDP, "the optimizer state not restored", 21,
     [("train_state = load_sharded_model(model, optimizer, resume, cfg.to_dict())",
       "train_state = load_sharded_model(model, None, resume, cfg.to_dict())")]),
    ("fsdp", FSDP, "best_val not restored", 21,
     [('        best_val = train_state["best_val"]\n', "")]),
    ("fsdp", FSDP, "loss_history not restored", 21,
     [('        loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]\n',
       "")]),
    ("fsdp", FSDP, "the epoch's batches not skipped", 21,
     [("step, start_epoch, start_batch = resume_position(",
       "step, start_epoch, _ = resume_position(")]),
    ("fsdp", FSDP, "resumed from step 0", 21,
     [("step, start_epoch, start_batch = resume_position(",
       "_, start_epoch, start_batch = resume_position(")]),
    ("fsdp", FSDP, "save0 for the final model", 22,
     [('    save_full_model(model, out_dir / "final_model.pt")',
       '    save0(model, out_dir / "final_model.pt")'),
      ("from utils.checkpointing import (load_sharded_model,",
       "from utils.distributed_utils import save0\nfrom utils.checkpointing import (load_sharded_model,")]),
    ("fsdp", FSDP, "save_full_model on rank 0 only", 22,
     [('    save_full_model(model, out_dir / "final_model.pt")',
       '    if rank == 0:\n        save_full_model(model, out_dir / "final_model.pt")')]),
    ("fsdp", FSDP, "the root sharded before the blocks", 18,
     [("    for block in model.layers.values():\n"
       "        fully_shard(block, reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n", ""),
      ("    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n",
       "    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n"
       "    for block in model.layers.values():\n"
       "        fully_shard(block, reshard_after_forward=reshard_after_forward,\n"
       "                    mp_policy=MixedPrecisionPolicy(**policy))\n")]),
    ("fsdp", FSDP, "the global batch saved as one rank's batch", 20,
     [("global_batch=global_batch, best_val=best_val", "global_batch=args.batch_size, best_val=best_val")]),
    ("fsdp", FSDP, "resume_position given the samples per epoch", 21,  # wrong at an epoch's end only
     [("len(train_loader), args.max_steps)", "len(train_ds), args.max_steps)")]),
    ("fsdp", FSDP, "--resume taken as the folder, without resume_checkpoint", 21,
     [('resume = resume_checkpoint(args.resume, out_dir / "checkpoints")', "resume = args.resume")]),
    ("fsdp", FSDP, "the checkpoint loaded on rank 0 only", 21,
     [("    if resume:\n        train_state = load_sharded_model(",
       "    if resume and rank == 0:\n        train_state = load_sharded_model(")]),
    ("fsdp", FSDP, "resume_position given this rank's batch", 21,
     [("resume_position(train_state, global_batch,", "resume_position(train_state, args.batch_size,")]),
    ("fsdp", FSDP, "a restart without --resume starts at step 0", 21,
     [('    resume = resume_checkpoint(args.resume, out_dir / "checkpoints")',
       '    resume = resume_checkpoint(args.resume, out_dir / "checkpoints") if args.resume else None')]),
    ("fsdp", FSDP, "every rank says where it resumed", 21,
     [('        print0(f"resumed from {resume} at step', '        print(f"resumed from {resume} at step')]),
    ("fsdp", FSDP, "--reshard-after-forward as type=bool", 18,
     [('    parser.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",',
       '    parser.add_argument("--reshard-after-forward", type=bool, default=True,'),
      ('args.reshard_after_forward == "true")', "args.reshard_after_forward)")]),
    ("fsdp", FSDP, "--reshard-after-forward as store_true", 18,
     [('    parser.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",',
       '    parser.add_argument("--reshard-after-forward", action="store_true",'),
      ('args.reshard_after_forward == "true")', "args.reshard_after_forward)")]),
    ("fsdp", FSDP, "resume_checkpoint looks in OUT_DIR, the checkpoints are in OUT_DIR/checkpoints", 21,
     [('resume_checkpoint(args.resume, out_dir / "checkpoints")', "resume_checkpoint(args.resume, out_dir)")]),
    ("fsdp", FSDP, "the string 'false' turned into a bool for apply_fsdp", 19,
     [('args.reshard_after_forward == "true")', "bool(args.reshard_after_forward))")]),
    ("fsdp", FSDP, "loss_history restored as floats", 21,
     [('loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]',
       'loss_history = train_state["loss_history"]')]),
    ("fsdp", FSDP, "the model's configuration saved as config", 20,
     [("model_config=cfg.to_dict())", "config=cfg.to_dict())")]),
    ("fsdp", FSDP, "the step saved as steps", 20,
     [("train_state = dict(step=step,", "train_state = dict(steps=step,")]),
    ("fsdp", FSDP, "best_val neither saved nor restored", 20,
     [("global_batch=global_batch, best_val=best_val,", "global_batch=global_batch,"),
      ('        best_val = train_state["best_val"]\n', "")]),
    ("fsdp", FSDP, "the best validation loss saved as best_val_loss, read back as best_val", 20,
     [("best_val=best_val,", "best_val_loss=best_val,")]),
    ("fsdp", FSDP, "best_val saved, read back as best_val_loss", 21,
     [('train_state["best_val"]', 'train_state["best_val_loss"]')]),
    ("fsdp", FSDP, "no line says where the run resumed", 21,
     [('        print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")\n',
       "")]),
    ("fsdp", FSDP, "rank 0 says where it resumed, not at which step", 21,
     [('print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")',
       'print0(f"resumed from {resume}")')]),
    ("fsdp", FSDP, "every rank says where it resumed, in other words", 21,
     [('print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")',
       'print(f"continuing at step {step} with the weights of {resume}")')]),
    # ---- TP ----------------------------------------------------------------------------
    ("tp", TP, "loss_parallel not imported", 23,
     [("from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,\n"
       "                                               parallelize_module)",
       "from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,\n"
       "                                               parallelize_module)")]),
    ("tp", TP, "os not imported", 23, [("import os\n\n", "\n")]),
    ("tp", TP, "model.layers iterated (its names, not its blocks)", 24,
     [("    for block in model.layers.values():\n        parallelize_module(",
       "    for block in model.layers:\n        parallelize_module(")]),
    ("tp", TP, "out_proj column-wise", 24,
     [('"attn.out_proj": RowwiseParallel(),', '"attn.out_proj": ColwiseParallel(),')]),
    ("tp", TP, "the embedding not split", 24,
     [('        "tok_emb": RowwiseParallel(input_layouts=Replicate()),\n', "")]),
    ("tp", TP, "the output layer returns local logits", 24,
     [('"output": ColwiseParallel(use_local_output=False),', '"output": ColwiseParallel(),')]),
    ("tp", TP, "--tp defaults to 1", 25,
     [('default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),', "default=1,")]),
    ("tp", TP, "--tp defaults to the world size", 25,
     [('default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),',
       'default=int(os.environ.get("WORLD_SIZE", 1)),')]),
    ("tp", TP, "--tp without a type", 25,
     [('parser.add_argument("--tp", type=positive_int,', 'parser.add_argument("--tp",')]),
    ("tp", TP, "the mesh the wrong way round", 26,
     [("(world_size // args.tp, args.tp),\n                            mesh_dim_names=(\"dp\", \"tp\"))",
       "(args.tp, world_size // args.tp),\n                            mesh_dim_names=(\"dp\", \"tp\"))")]),
    ("tp", TP, "no check_tp_degree", 26, [("    check_tp_degree(args.tp, world_size, cfg)\n", "")]),
    ("tp", TP, "dp_rank is the global rank", 26,
     [('dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()',
       'dp_rank, dp_size = rank, mesh["dp"].size()')]),
    ("tp", TP, "samplers count processes", 27,
     [("DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank,",
       "DistributedSampler(train_ds, num_replicas=world_size, rank=rank,")]),
    ("tp", TP, "tokens of one replica (not times dp_size)", 31,
     [("throughput.step(x.numel() * dp_size)", "throughput.step(x.numel())")]),
    ("tp", TP, "params_per_rank left out of the summary", 31,
     [("        params_per_rank=local_params, memory=monitor.memory)", "        memory=monitor.memory)")]),
    ("tp", TP, "evaluation samplers of one replica (every replica evaluates everything)", 27,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=dp_size, rank=dp_rank)",
       "val_sampler = DistributedEvalSampler(val_ds, num_replicas=1, rank=0)"),
      ("test_sampler = DistributedEvalSampler(test_ds, num_replicas=dp_size, rank=dp_rank)",
       "test_sampler = DistributedEvalSampler(test_ds, num_replicas=1, rank=0)")]),
    ("tp", TP, "the training sampler of one replica (both replicas read the same batches)", 27,
     [("DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank,",
       "DistributedSampler(train_ds, num_replicas=1, rank=0,")]),
    ("tp", TP, "the output layer's logits replicated", 24,
     [('"output": ColwiseParallel(use_local_output=False),',
       '"output": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),')]),
    ("tp", TP, "the loss under loss_parallel kept a DTensor", 30,
     [("            loss = loss.full_tensor()\n", "")]),
    ("tp", TP, "evaluate's loss sum kept a DTensor", 33,
     [("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "apply_tp after fully_shard", 28,
     [('    model = apply_tp(model, mesh["tp"])\n', ""),
      ('    fully_shard(model, mesh=mesh["dp"])\n',
       '    fully_shard(model, mesh=mesh["dp"])\n    model = apply_tp(model, mesh["tp"])\n')]),
    ("tp", TP, "dp_rank from the tp dim", 26,
     [('dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()',
       'dp_rank, dp_size = mesh["tp"].get_local_rank(), mesh["dp"].size()')]),
    ("tp", TP, "a mesh without dim names", 26,
     [('    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp),\n'
       '                            mesh_dim_names=("dp", "tp"))',
       "    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp))")]),
    ("tp", TP, "FSDP over the whole 2-D mesh", 29,
     [('fully_shard(block, mesh=mesh["dp"])', "fully_shard(block, mesh=mesh)"),
      ('fully_shard(model, mesh=mesh["dp"])', "fully_shard(model, mesh=mesh)")]),
    ("tp", TP, "a CUDA mesh written in", 26,
     [("mesh = init_device_mesh(device.type,", 'mesh = init_device_mesh("cuda",')]),
    ("tp", TP, "the sampler's rank from the processes, its count from the replicas", 27,
     [("DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank,",
       "DistributedSampler(train_ds, num_replicas=dp_size, rank=rank,")]),
    ("tp", TP, "evaluation samplers count processes", 27,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=dp_size, rank=dp_rank)",
       "val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)")]),
    ("tp", TP, "apply_tp on the whole mesh", 28,
     [('model = apply_tp(model, mesh["tp"])', "model = apply_tp(model, mesh)")]),
    ("tp", TP, "apply_tp never called", 28,
     [('    model = apply_tp(model, mesh["tp"])\n', "")]),
    ("tp", TP, "DDP kept", 29,
     [('    for block in model.layers.values():\n        fully_shard(block, mesh=mesh["dp"])\n'
       '    fully_shard(model, mesh=mesh["dp"])\n',
       '    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n'),
      ("import os\n\n", "import os\n\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n")]),
    ("tp", TP, "FSDP on the root only", 29,
     [('    for block in model.layers.values():\n        fully_shard(block, mesh=mesh["dp"])\n', "")]),
    ("tp", TP, "backward after loss_parallel() ended", 30,
     [("                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                optimizer.zero_grad(set_to_none=True)\n"
       "                loss.backward()\n",
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "            optimizer.zero_grad(set_to_none=True)\n"
       "            loss.backward()\n")]),
    ("tp", TP, "no loss_parallel in training", 30,
     [("            with loss_parallel():\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                optimizer.zero_grad(set_to_none=True)\n"
       "                loss.backward()\n",
       "            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "            optimizer.zero_grad(set_to_none=True)\n"
       "            loss.backward()\n")]),
    ("tp", TP, "the logits gathered instead of loss_parallel", 30,
     [("            with loss_parallel():\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                optimizer.zero_grad(set_to_none=True)\n"
       "                loss.backward()\n"
       "            loss = loss.full_tensor()\n",
       "            loss = F.cross_entropy(logits.full_tensor().flatten(0, 1), y.flatten())\n"
       "            optimizer.zero_grad(set_to_none=True)\n"
       "            loss.backward()\n")]),
    ("tp", TP, "tokens counted per process", 31,
     [("throughput.step(x.numel() * dp_size)", "throughput.step(x.numel() * world_size)")]),
    ("tp", TP, "the summary without the TP sizes", 31,
     [("        data_parallel_size=dp_size, tensor_parallel_size=args.tp,\n"
       "        params_per_rank=local_params, memory=monitor.memory)",
       "        params_per_rank=local_params, memory=monitor.memory)")]),
    ("tp", TP, "the loss averaged over all processes, TP copies included", 31,
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = all_reduce_mean(loss.detach())")]),
    ("tp", TP, "the loss averaged over the TP group instead of the replicas", 31,
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       'step_loss = all_reduce_mean(loss.detach(), group=mesh["tp"].get_group())')]),
    ("tp", TP, "save0 of the TP model", 32,  # save0 as the exercise had it, and imports
     [('    save_full_model(model, out_dir / "final_model.pt")',
       '    save0(model, out_dir / "final_model.pt")'),
      ("from utils.checkpointing import save_full_model",
       "from utils.checkpointing import save_full_model\nfrom utils.distributed_utils import save0")]),
    ("tp", TP, "save_full_model on rank 0 only", 32,
     [('            save_full_model(model, out_dir / "best_model.pt")',
       '            if rank == 0:\n                save_full_model(model, out_dir / "best_model.pt")')]),
    ("tp", TP, "evaluation without loss_parallel", 33,
     [("        with loss_parallel():\n            loss_sum += F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                        "
       "ignore_index=IGNORE_INDEX).full_tensor()",
       "        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction=\"sum\",\n"
       "                                    ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "evaluation sums added up over all processes", 33,
     [("loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)",
       "loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)")]),
    ("tp", TP, "evaluation over the TP group", 33,
     [("val_loss = evaluate(model, val_loader, device, dp_group)",
       'val_loss = evaluate(model, val_loader, device, mesh["tp"].get_group())'),
      ("test_loss = evaluate(model, test_loader, device, dp_group)",
       'test_loss = evaluate(model, test_loader, device, mesh["tp"].get_group())')]),
    ("tp", TP, "no reshard after evaluation", 33,
     [("    model.reshard()  # FSDP frees the root's gathered weights after backward; evaluation has none\n",
       "")]),
    ("tp", TP, "the MLP's projections the other way round", 24,
     [('"mlp.in_proj": ColwiseParallel(),', '"mlp.in_proj": RowwiseParallel(),'),
      ('"mlp.out_proj": RowwiseParallel(),', '"mlp.out_proj": ColwiseParallel(),')]),
    ("tp", TP, "k_proj left out of the plan", 24,
     [('            "attn.k_proj": ColwiseParallel(),   # (the model\'s view(b, t, -1, head_dim)\n', "")]),
    ("tp", TP, "the embedding's input not replicated", 24,
     [('"tok_emb": RowwiseParallel(input_layouts=Replicate()),', '"tok_emb": RowwiseParallel(),')]),
    ("tp", TP, "--tp defaults to LOCAL_WORLD_SIZE without a fallback", 25,
     [('default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),',
       'default=int(os.environ["LOCAL_WORLD_SIZE"]),')]),
    ("tp", TP, "the mesh's names the other way round", 26,
     [('mesh_dim_names=("dp", "tp"))', 'mesh_dim_names=("tp", "dp"))')]),
    ("tp", TP, "dp_group from the tp dim", 26,
     [('dp_group = mesh["dp"].get_group()', 'dp_group = mesh["tp"].get_group()')]),
    ("tp", TP, "local_params from the DTensors' global sizes", 28,
     [("local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()\n"
       "                       for p in model.parameters())",
       "local_params = sum(p.numel() for p in model.parameters())")]),
    ("tp", TP, "the blocks sharded without the dp mesh", 29,
     [('        fully_shard(block, mesh=mesh["dp"])', "        fully_shard(block)")]),
    # TODO 23 done as its solution (DDP's import gone), TODO 29 as shipped: DDP still used
    ("tp", TP, "DDP's import gone before TODO 29 replaces DDP", 29,
     [('    for block in model.layers.values():\n        fully_shard(block, mesh=mesh["dp"])\n'
       '    fully_shard(model, mesh=mesh["dp"])\n',
       '    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n')]),
    ("tp", TP, "dp_rank from mesh['dp'].get_rank() (the global rank)", 26,
     [('dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()',
       'dp_rank, dp_size = mesh["dp"].get_rank(), mesh["dp"].size()')]),
    # The evaluation stops the run at the end of the first epoch (its loss mixes plain tensors
    # and DTensors): the training before it is judged from what ran (the steps logged, the
    # samplers, the FSDP units), so a training mistake is its TODO's FIX, not "not checked"
    ("tp", TP, "evaluation's loss taken whole without loss_parallel", 33,
     [("        with loss_parallel():\n            loss_sum += F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                        "
       "ignore_index=IGNORE_INDEX).full_tensor()",
       "        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction=\"sum\",\n"
       "                                    ignore_index=IGNORE_INDEX).full_tensor()")]),
    ("tp", TP, "samplers count processes, and evaluate's loss sum kept a DTensor", 27,
     [("DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank,",
       "DistributedSampler(train_ds, num_replicas=world_size, rank=rank,"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "evaluation samplers without num_replicas and rank, and evaluate's loss sum "
     "kept a DTensor", 27,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=dp_size, rank=dp_rank)",
       "val_sampler = DistributedEvalSampler(val_ds)"),
      ("test_sampler = DistributedEvalSampler(test_ds, num_replicas=dp_size, rank=dp_rank)",
       "test_sampler = DistributedEvalSampler(test_ds)"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "the logits gathered in training, and evaluation without loss_parallel", 30,
     [("            with loss_parallel():\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                optimizer.zero_grad(set_to_none=True)\n"
       "                loss.backward()\n"
       "            loss = loss.full_tensor()\n",
       "            loss = F.cross_entropy(logits.full_tensor().flatten(0, 1), y.flatten())\n"
       "            optimizer.zero_grad(set_to_none=True)\n"
       "            loss.backward()\n"),
      ("        with loss_parallel():\n            loss_sum += F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                        "
       "ignore_index=IGNORE_INDEX).full_tensor()",
       "        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction=\"sum\",\n"
       "                                    ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "tokens of one replica, and evaluate's loss sum kept a DTensor", 31,
     [("throughput.step(x.numel() * dp_size)", "throughput.step(x.numel())"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "the training loss summed over the replicas, and evaluate's loss sum kept a "
     "DTensor", 31,
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = all_reduce_sum(loss.detach(), dp_group)"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "the training loss summed over the replicas", 31,
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = all_reduce_sum(loss.detach(), dp_group)")]),
    # The check's second run, two nodes of one process (tp 1, dp 2), stops where the first
    # does not: a FIX under the TODO of its line, saying which run it was
    ("tp", TP, "apply_tp leaves tp 1 whole, and the loss's full_tensor() stops the run on two "
     "nodes", 30,
     [("    for block in model.layers.values():\n        parallelize_module(",
       "    if tp_mesh.size() == 1:  # nothing to split\n        return model\n"
       "    for block in model.layers.values():\n        parallelize_module(")]),
    ("tp", TP, "apply_tp leaves tp 1 whole, and evaluate's full_tensor() stops the run on two "
     "nodes", 33,
     [("    for block in model.layers.values():\n        parallelize_module(",
       "    if tp_mesh.size() == 1:  # nothing to split\n        return model\n"
       "    for block in model.layers.values():\n        parallelize_module("),
      ("            loss = loss.full_tensor()\n",
       "            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss\n")]),
    ("tp", TP, "apply_tp leaves tp 1 whole, evaluate stops on two nodes, and the training loss "
     "not averaged", 31,
     [("    for block in model.layers.values():\n        parallelize_module(",
       "    if tp_mesh.size() == 1:  # nothing to split\n        return model\n"
       "    for block in model.layers.values():\n        parallelize_module("),
      ("            loss = loss.full_tensor()\n",
       "            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss\n"),
      ("step_loss = all_reduce_mean(loss.detach(), group=dp_group)", "step_loss = loss.detach()")]),
    ("tp", TP, "apply_tp leaves tp 1 whole (two nodes stop in training), and evaluate's loss sum "
     "kept a DTensor", 30,
     [("    for block in model.layers.values():\n        parallelize_module(",
       "    if tp_mesh.size() == 1:  # nothing to split\n        return model\n"
       "    for block in model.layers.values():\n        parallelize_module("),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    # only dp 2 shows these: each replica's own loss, a mean of the replicas' means
    ("tp", TP, "the training loss not averaged (each replica logs its own)", 31,
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)", "step_loss = loss.detach()")]),
    ("tp", TP, "evaluate returns the mean of the replicas' means", 33,
     [("    loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)\n"
       "    model.reshard()  # FSDP frees the root's gathered weights after backward; evaluation has none\n"
       "    model.train()\n    return (loss_sum / tokens).item()",
       "    model.reshard()  # FSDP frees the root's gathered weights after backward; evaluation has none\n"
       "    model.train()\n    return all_reduce_mean(loss_sum / tokens, dp_group).item()")]),
    # more training mistakes with evaluate() stopping the run: each its own TODO's FIX
    ("tp", TP, "local_params from the DTensors' global sizes, and evaluate's loss sum kept a "
     "DTensor", 28,
     [("local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()\n"
       "                       for p in model.parameters())",
       "local_params = sum(p.numel() for p in model.parameters())"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "FSDP on the root only, and evaluate's loss sum kept a DTensor", 29,
     [('    for block in model.layers.values():\n        fully_shard(block, mesh=mesh["dp"])\n', ""),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "dp_group from the tp dim, and evaluate's loss sum kept a DTensor", 26,
     [('dp_group = mesh["dp"].get_group()', 'dp_group = mesh["tp"].get_group()'),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "the loss averaged over all processes, and evaluate's loss sum kept a DTensor", 31,
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = all_reduce_mean(loss.detach())"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "evaluation samplers of one replica, and evaluate's loss sum kept a DTensor", 27,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=dp_size, rank=dp_rank)",
       "val_sampler = DistributedEvalSampler(val_ds, num_replicas=1, rank=0)"),
      ("test_sampler = DistributedEvalSampler(test_ds, num_replicas=dp_size, rank=dp_rank)",
       "test_sampler = DistributedEvalSampler(test_ds, num_replicas=1, rank=0)"),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    # a plan mistake that trains (the embedding whole) has no part in evaluate()'s crash
    ("tp", TP, "the embedding not split, and evaluate's loss sum kept a DTensor", 33,
     [('        "tok_emb": RowwiseParallel(input_layouts=Replicate()),\n', ""),
      ("ignore_index=IGNORE_INDEX).full_tensor()", "ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "evaluate given the dp sub-mesh instead of its group", 33,
     [("val_loss = evaluate(model, val_loader, device, dp_group)",
       'val_loss = evaluate(model, val_loader, device, mesh["dp"])'),
      ("test_loss = evaluate(model, test_loader, device, dp_group)",
       'test_loss = evaluate(model, test_loader, device, mesh["dp"])')]),
    ("tp", TP, "FSDP on the root only, and evaluate given the dp sub-mesh", 29,
     [("val_loss = evaluate(model, val_loader, device, dp_group)",
       'val_loss = evaluate(model, val_loader, device, mesh["dp"])'),
      ('    for block in model.layers.values():\n        fully_shard(block, mesh=mesh["dp"])\n', "")]),
    ("tp", TP, "evaluate's loss on the local logits (to_local())", 33,
     [("        with loss_parallel():\n            loss_sum += F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                        "
       "ignore_index=IGNORE_INDEX).full_tensor()",
       "        loss_sum += F.cross_entropy(logits.to_local().flatten(0, 1), y.flatten(), "
       "reduction=\"sum\",\n                                    ignore_index=IGNORE_INDEX)")]),
    ("tp", TP, "tokens of one replica, and evaluate's loss on the local logits", 31,
     [("        with loss_parallel():\n            loss_sum += F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                        "
       "ignore_index=IGNORE_INDEX).full_tensor()",
       "        loss_sum += F.cross_entropy(logits.to_local().flatten(0, 1), y.flatten(), "
       "reduction=\"sum\",\n                                    ignore_index=IGNORE_INDEX)"),
      ("throughput.step(x.numel() * dp_size)", "throughput.step(x.numel())")]),
    ("tp", TP, "check_tp_degree after the mesh is built", 26,
     [("    check_tp_degree(args.tp, world_size, cfg)\n", ""),
      ('    dp_group = mesh["dp"].get_group()\n',
       '    dp_group = mesh["dp"].get_group()\n    check_tp_degree(args.tp, world_size, cfg)\n')]),
    # ---- PP ----------------------------------------------------------------------------
    ("pp", PP, "every stage keeps the final norm", 34,
     [("        model.norm = model.output = None", "        model.output = None")]),
    ("pp", PP, "the last stage keeps pos_emb", 34,
     [("        model.tok_emb = model.pos_emb = None", "        model.tok_emb = None")]),
    ("pp", PP, "every stage keeps every block", 34,
     [("        if int(name) not in owned:\n            del model.layers[name]\n",
       "        pass\n")]),
    ("pp", PP, "a split that loses a layer", 34,
     [("    owned = stage_layers(len(model.layers), num_stages, layers_per_stage)[stage_index]",
       "    owned = stage_layers(len(model.layers), num_stages, layers_per_stage)[stage_index][:-1]")]),
    ("pp", PP, "the stages read different batches", 35,
     [("DistributedSampler(train_ds, num_replicas=1, rank=0,",
       "DistributedSampler(train_ds, num_replicas=world_size, rank=rank,")]),
    ("pp", PP, "the evaluation samplers split the replica", 35,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=1, rank=0)",
       "val_sampler = DistributedEvalSampler(val_ds, num_replicas=world_size, rank=rank)")]),
    ("pp", PP, "the stage built with the local rank", 36,
     [("    stage = PipelineStage(model, stage_index, num_stages, device)",
       "    stage = PipelineStage(model, local_rank, num_stages, device)")]),
    ("pp", PP, "an evaluation schedule that averages", 36,
     [('eval_schedule = build_schedule("gpipe", eval_stage, args.microbatches, lm_loss_sum)',
       'eval_schedule = build_schedule("gpipe", eval_stage, args.microbatches, lm_loss)')]),
    # the pattern the course had: the first evaluation prepared the shared stage for forward
    # only, and the stages before the last trained on zero gradients after it
    ("pp", PP, "the evaluation schedule on the training's stage", 36,
     [("    eval_stage = PipelineStage(model, stage_index, num_stages, device)\n"
       '    eval_schedule = build_schedule("gpipe", eval_stage,',
       '    eval_schedule = build_schedule("gpipe", stage,'),
      ("    del stage, eval_stage, schedule, eval_schedule",
       "    del stage, schedule, eval_schedule")]),
    ("pp", PP, "no bubble timer", 36,
     [("    timer = StageBusyTimer(stage, device)\n", ""),
      ("            timer.start_step()\n", ""),
      ("            idle_history.append(timer.idle_fraction())\n", "")]),
    ("pp", PP, "the last stage keeps no losses", 37,
     [("target=y if stage.is_last else None, losses=losses)\n            idle_history",
       "target=y if stage.is_last else None)\n            idle_history")]),
    ("pp", PP, "gradients zeroed after the schedule", 37,
     [("            optimizer.zero_grad(set_to_none=True)\n            timer.start_step()\n",
       "            timer.start_step()\n"),
      ("            idle_history.append(timer.idle_fraction())\n",
       "            idle_history.append(timer.idle_fraction())\n"
       "            optimizer.zero_grad(set_to_none=True)\n")]),
    ("pp", PP, "the microbatches' losses summed", 38,
     [("step_loss = (torch.stack(losses).detach().mean() if stage.is_last",
       "step_loss = (torch.stack(losses).detach().sum() if stage.is_last")]),
    ("pp", PP, "the loss broadcast from the first stage", 38,
     [("            dist.broadcast(step_loss, src=num_stages - 1)",
       "            dist.broadcast(step_loss, src=0)")]),
    ("pp", PP, "the loss averaged over the stages", 38,  # all_reduce_mean: the exercise imports it
     [("            dist.broadcast(step_loss, src=num_stages - 1)",
       "            step_loss = all_reduce_mean(step_loss)"),
     ("from utils.distributed_utils import all_reduce_sum,",
       "from utils.distributed_utils import all_reduce_mean, all_reduce_sum, save0,"),
     ]),
    ("pp", PP, "the loss taken on every stage", 38,
     [("            step_loss = (torch.stack(losses).detach().mean() if stage.is_last\n"
       "                         else torch.zeros((), device=device))",
       "            step_loss = torch.stack(losses).detach().mean()")]),
    ("pp", PP, "tokens counted per stage", 38,
     [("            throughput.step(x.numel())", "            throughput.step(x.numel() * world_size)")]),
    ("pp", PP, "save0 of one stage", 39,  # save0 as the exercise had it, and imports
     [('    with atomic_folder(out_dir / "final_model") as folder:\n'
       '        dcp.save(model.state_dict(), checkpoint_id=folder)',
       '    save0(model, out_dir / "final_model.pt")'),
     ("from utils.distributed_utils import all_reduce_sum,",
       "from utils.distributed_utils import all_reduce_mean, all_reduce_sum, save0,"),
     ]),
    ("pp", PP, "DCP save on rank 0 only", 39,
     [('    with atomic_folder(out_dir / "final_model") as folder:\n'
       '        dcp.save(model.state_dict(), checkpoint_id=folder)',
       '    if rank == 0:\n'
       '        with atomic_folder(out_dir / "final_model") as folder:\n'
       '            dcp.save(model.state_dict(), checkpoint_id=folder)')]),
    ("pp", PP, "the split made with the local rank (the stage with the global)", 36,
     [("    model = split_pipeline_stage(model, stage_index, num_stages, args.layers_per_stage)",
       "    model = split_pipeline_stage(model, local_rank, num_stages, args.layers_per_stage)")]),
    ("pp", PP, "microbatch size given as the number of microbatches", 36,
     [("    schedule = build_schedule(args.schedule, stage, args.microbatches, lm_loss)",
       "    schedule = build_schedule(args.schedule, stage, args.batch_size // args.microbatches, "
       "lm_loss)")]),
    ("pp", PP, "the loss_fn given to the last stage's schedule only", 36,
     [("    schedule = build_schedule(args.schedule, stage, args.microbatches, lm_loss)",
       "    schedule = build_schedule(args.schedule, stage, args.microbatches,\n"
       "                              lm_loss if stage.is_last else None)")]),
    ("pp", PP, "samplers with num_replicas=1 but rank=rank", 35,
     [("DistributedSampler(train_ds, num_replicas=1, rank=0,",
       "DistributedSampler(train_ds, num_replicas=1, rank=rank,")]),
    ("pp", PP, "DCP state_dict nested under 'model'", 39,
     [('    with atomic_folder(out_dir / "final_model") as folder:\n'
       '        dcp.save(model.state_dict(), checkpoint_id=folder)',
       '    with atomic_folder(out_dir / "final_model") as folder:\n'
       '        dcp.save({"model": model.state_dict()}, checkpoint_id=folder)')]),
    ("pp", PP, "evaluation without the training autocast", 40,
     [("        with autocast(precision, device):  # the dtypes the stages send in training\n"
       "            schedule.eval(",
       "        if True:\n            schedule.eval(")]),
    ("pp", PP, "no broadcast after evaluation", 40,
     [("    dist.broadcast(loss_sum, src=dist.get_world_size() - 1)\n", "")]),
    ("pp", PP, "the last batch not padded", 40,
     [("        x, y = pad_batch(x, y, loader.batch_size)  # the pipeline's buffers have one shape\n",
       "")]),
    ("pp", PP, "training mode not restored after evaluation", 40,
     [("    model.train()\n    return (loss_sum / tokens).item()",
       "    return (loss_sum / tokens).item()")]),
    ("pp", PP, "the loss broadcast on the last stage only", 38,  # the ranks wait apart
     [("            dist.broadcast(step_loss, src=num_stages - 1)",
       "            if stage.is_last:\n                dist.broadcast(step_loss, src=num_stages - 1)")]),
    ("pp", PP, "the evaluation's inputs padded with IGNORE_INDEX", 40,  # padded by hand
     [("        x, y = pad_batch(x, y, loader.batch_size)  # the pipeline's buffers have one shape\n",
       "        if len(x) < loader.batch_size:\n"
       "            pad = loader.batch_size - len(x)\n"
       "            x = torch.cat([x, x.new_full((pad, x.shape[1]), IGNORE_INDEX)])\n"
       "            y = torch.cat([y, y.new_full((pad, y.shape[1]), IGNORE_INDEX)])\n")]),
    ("pp", PP, "the training schedule built with the summing loss", 36,
     [("    schedule = build_schedule(args.schedule, stage, args.microbatches, lm_loss)",
       "    schedule = build_schedule(args.schedule, stage, args.microbatches, lm_loss_sum)")]),
    ("pp", PP, "the first and the last stage's parts swapped", 34,  # the run stops
     [("    if stage_index != 0:\n        model.tok_emb = model.pos_emb = None\n"
       "    if stage_index != num_stages - 1:\n        model.norm = model.output = None",
       "    if stage_index != num_stages - 1:\n        model.tok_emb = model.pos_emb = None\n"
       "    if stage_index != 0:\n        model.norm = model.output = None")]),
    ("pp", PP, "the kept blocks renumbered from 0 in a new ModuleDict", 34,
     [("    for name in list(model.layers):\n        if int(name) not in owned:\n"
       "            del model.layers[name]\n",
       "    model.layers = torch.nn.ModuleDict({str(i): model.layers[str(n)]\n"
       "                                        for i, n in enumerate(owned)})\n")]),
    ("pp", PP, "no zero_grad before schedule.step", 37,
     [("            optimizer.zero_grad(set_to_none=True)\n            timer.start_step()\n",
       "            timer.start_step()\n")]),
    ("pp", PP, "optimizer.step() on the last stage only", 37,  # the ranks wait apart
     [("            idle_history.append(timer.idle_fraction())\n            optimizer.step()\n",
       "            idle_history.append(timer.idle_fraction())\n            if stage.is_last:\n"
       "                optimizer.step()\n")]),
    ("pp", PP, "schedule.eval without losses=", 40,
     [("                          target=y if stage.is_last else None, losses=losses)\n"
       "        if losses",
       "                          target=y if stage.is_last else None)\n        if losses")]),
    ("pp", PP, "schedule.eval without target=", 40,  # the last stage's loss_fn stops
     [("                          target=y if stage.is_last else None, losses=losses)\n"
       "        if losses",
       "                          losses=losses)\n        if losses")]),
    ("pp", PP, "evaluation tokens counted on the last stage only", 40,
     [("        if losses:\n            loss_sum += torch.stack(losses).sum()\n"
       "        tokens += (y != IGNORE_INDEX).sum()",
       "        if losses:\n            loss_sum += torch.stack(losses).sum()\n"
       "            tokens += (y != IGNORE_INDEX).sum()")]),
    ("pp", PP, "evaluation with the training schedule", 40,
     [("val_loss = evaluate(model, val_loader, device, stage, eval_schedule, args.precision)",
       "val_loss = evaluate(model, val_loader, device, stage, schedule, args.precision)"),
      ("test_loss = evaluate(model, test_loader, device, stage, eval_schedule, args.precision)",
       "test_loss = evaluate(model, test_loader, device, stage, schedule, args.precision)")]),
    ("pp", PP, "the evaluation's microbatch sums averaged", 40,
     [("            loss_sum += torch.stack(losses).sum()",
       "            loss_sum += torch.stack(losses).mean()")]),
    ("pp", PP, "the evaluation stage built on a copy of the model", 36,
     [("    eval_stage = PipelineStage(model, stage_index",
       '    eval_stage = PipelineStage(__import__("copy").deepcopy(model), stage_index')]),
    ("pp", PP, "--layers-per-stage not passed on", 36,
     [("split_pipeline_stage(model, stage_index, num_stages, args.layers_per_stage)",
       "split_pipeline_stage(model, stage_index, num_stages)")]),
    ("pp", PP, "the loss broadcast's result assigned", 38,  # None: the next line stops
     [("            dist.broadcast(step_loss, src=num_stages - 1)",
       "            step_loss = dist.broadcast(step_loss, src=num_stages - 1)")]),
    ("pp", PP, "the loss broadcast from each rank's own stage", 38,  # the ranks wait apart
     [("            dist.broadcast(step_loss, src=num_stages - 1)",
       "            dist.broadcast(step_loss, src=stage_index)")]),
    ("pp", PP, "the evaluation's padded targets 0", 40,  # padded by hand
     [("        x, y = pad_batch(x, y, loader.batch_size)  # the pipeline's buffers have one shape\n",
       "        if len(x) < loader.batch_size:\n"
       "            pad = loader.batch_size - len(x)\n"
       "            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])\n"
       "            y = torch.cat([y, y.new_zeros(pad, y.shape[1])])\n")]),
    ("pp", PP, "the evaluation's padding counted in the tokens", 40,
     [("        tokens += (y != IGNORE_INDEX).sum()", "        tokens += y.numel()")]),
    ("pp", PP, "blocks deleted while the loop walks model.layers", 34,  # RuntimeError midway
     [("    for name in list(model.layers):\n", "    for name in model.layers:\n")]),
    ("pp", PP, "evaluate still runs the model itself (TODO 40 as shipped)", 40,
     [("val_loss = evaluate(model, val_loader, device, stage, eval_schedule, args.precision)",
       "val_loss = evaluate(model, val_loader, device)"),
      ("test_loss = evaluate(model, test_loader, device, stage, eval_schedule, args.precision)",
       "test_loss = evaluate(model, test_loader, device)"),
      ("def evaluate(model, loader, device, stage, schedule, precision):",
       "def evaluate(model, loader, device):"),
      ("        x, y = pad_batch(x, y, loader.batch_size)  # the pipeline's buffers have one shape\n"
       "        losses = []\n"
       "        with autocast(precision, device):  # the dtypes the stages send in training\n"
       "            schedule.eval(*((x,) if stage.is_first else ()),\n"
       "                          target=y if stage.is_last else None, losses=losses)\n"
       "        if losses:\n"
       "            loss_sum += torch.stack(losses).sum()\n",
       "        logits = model(x)\n"
       '        loss_sum += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",\n'
       "                                    ignore_index=IGNORE_INDEX)\n"),
      ("    dist.broadcast(loss_sum, src=dist.get_world_size() - 1)",
       "    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)")]),
    # the exercise's zero_grad left where it was, between the forward and the backward pass
    ("pp", PP, "zero_grad left between schedule.step and optimizer.step", 37,
     [("            optimizer.zero_grad(set_to_none=True)\n            timer.start_step()\n",
       "            timer.start_step()\n"),
      ("                              target=y if stage.is_last else None, losses=losses)\n"
       "            idle_history",
       "                              target=y if stage.is_last else None, losses=losses)\n"
       "            optimizer.zero_grad(set_to_none=True)\n            idle_history")]),
    ("pp", PP, "schedule.step outside the autocast", 37,
     [("            with autocast(args.precision, device):  # bf16 matmuls; the weights stay fp32\n"
       "                schedule.step(",
       "            if True:\n                schedule.step(")]),
    # TODO 39's import line done (all_reduce_mean gone), TODO 38 as shipped: it still uses it
    ("pp", PP, "all_reduce_mean's import gone before TODO 38 replaces it", 38,
     [("            throughput.step(x.numel())\n"
       "            step_loss = (torch.stack(losses).detach().mean() if stage.is_last\n"
       "                         else torch.zeros((), device=device))\n"
       "            dist.broadcast(step_loss, src=num_stages - 1)\n",
       "            throughput.step(x.numel() * world_size)\n"
       "            # Each rank's loss covers only its own batch: log the mean over all ranks.\n"
       "            step_loss = all_reduce_mean(loss.detach())\n")]),
    ("pp", PP, "the bubble timer on the evaluation stage", 36,
     [("    timer = StageBusyTimer(stage, device)", "    timer = StageBusyTimer(eval_stage, device)")]),
    ("pp", PP, "timer.start_step() after schedule.step", 37,
     [("            timer.start_step()\n            losses = []\n", "            losses = []\n"),
      ("            idle_history.append(timer.idle_fraction())\n",
       "            timer.start_step()\n            idle_history.append(timer.idle_fraction())\n")]),
    ("pp", PP, "tokens counted on the last stage only (rank 0 reports none)", 38,
     [("            throughput.step(x.numel())",
       "            if stage.is_last:\n                throughput.step(x.numel())")]),
    ("pp", PP, "one replica, but the training sampler seeded per rank", 35,
     [("shuffle=True, seed=args.seed, drop_last=True)",
       "shuffle=True, seed=args.seed + rank, drop_last=True)")]),
    ("pp", PP, "the validation sampler with num_replicas=1 but rank=rank", 35,
     [("val_sampler = DistributedEvalSampler(val_ds, num_replicas=1, rank=0)",
       "val_sampler = DistributedEvalSampler(val_ds, num_replicas=1, rank=rank)")]),
    ("pp", PP, "the final model saved by dcp.save straight into its folder", 39,
     [('    with atomic_folder(out_dir / "final_model") as folder:\n'
       "        dcp.save(model.state_dict(), checkpoint_id=folder)\n",
       '    dcp.save(model.state_dict(), checkpoint_id=out_dir / "final_model")\n')]),
    ("pp", PP, "the training's autocast written out as bf16", 37,
     [("            with autocast(args.precision, device):  # bf16 matmuls; the weights stay fp32",
       '            with autocast("bf16", device):  # bf16 matmuls; the weights stay fp32')]),
    ("pp", PP, "the validation line printed on every rank", 40,
     [('        print0(f"epoch {epoch} validation loss {val_loss:.4f}',
       '        print(f"epoch {epoch} validation loss {val_loss:.4f}')]),
    # ---- the performance step ----------------------------------------------------------
    ("perf", PERF, "peak_flops and synchronize not imported", 41,
     [("from utils.metrics import peak_flops, synchronize\n", "")]),
    ("perf", PERF, "contextlib not imported", 41, [("import contextlib\n", "")]),
    ("perf", PERF, "a clock read without synchronize", 42,
     [("                synchronize(device)\n", "")]),
    ("perf", PERF, "MFU of all devices together", 42,
     [("MFU {rate * flops_per_tok / (peak * world_size):.1%}", "MFU {rate * flops_per_tok / peak:.1%}")]),
    ("perf", PERF, "tokens of one rank", 42,
     [("            interval_tokens += x.numel() * world_size", "            interval_tokens += x.numel()")]),
    ("perf", PERF, "the peak of bf16 written in (an fp32 run's MFU 15 times too small on a GPU)", 42,
     [("peak, peak_source = peak_flops(device, args.precision)",
       'peak, peak_source = peak_flops(device, "bf16")')]),
    ("perf", PERF, "the peak asked before set_precision (auto: fp32's peak on a GPU in bf16)", 42,
     [("    args.precision = set_precision(args.precision, device)\n",
       "    peak, peak_source = peak_flops(device, args.precision)\n"
       "    args.precision = set_precision(args.precision, device)\n"),
      ("    peak, peak_source = peak_flops(device, args.precision)\n    print0(f\"MFU against",
       "    print0(f\"MFU against")]),
    ("perf", PERF, "the peak not said", 42,
     [('    print0(f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")\n', "")]),
    ("perf", PERF, "the peak printed with one decimal in TFLOP/s (0.0 for the check's peak)", 42,
     [('print0(f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")',
       'print0(f"peak {peak / 1e12:.1f} TFLOP/s (PEAK_FLOPS)")')]),
    ("perf", PERF, "the clock read before synchronize", 42,
     [("                synchronize(device)\n"
       "                rate = interval_tokens / (time.perf_counter() - interval_start)\n",
       "                rate = interval_tokens / (time.perf_counter() - interval_start)\n"
       "                synchronize(device)\n")]),
    ("perf", PERF, "synchronize before the optimizer step is queued", 42,
     [("                synchronize(device)\n", ""),
      ('            with annotate("optimizer", device):\n                optimizer.step()\n',
       '            synchronize(device)\n'
       '            with annotate("optimizer", device):\n                optimizer.step()\n')]),
    ("perf", PERF, "the profiler records the CPU only, also on a GPU", 43,
     [("    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == \"cuda\" else [])",
       "    activities = [ProfilerActivity.CPU]")]),
    ("perf", PERF, "the operator table sorted by CPU time on a GPU", 43,
     [('sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"',
       'sort_by = "self_cpu_time_total"')]),
    ("perf", PERF, "the profiler stepped at the log steps only", 43,
     [("            if profiler is not None:\n                profiler.step()\n", ""),
      ("                interval_tokens, interval_start = 0, time.perf_counter()\n",
       "                interval_tokens, interval_start = 0, time.perf_counter()\n"
       "                if profiler is not None:\n                    profiler.step()\n")]),
    ("perf", PERF, "no NVTX range on a GPU", 44,
     [('    if device.type == "cuda":\n        ranges.enter_context(torch.cuda.nvtx.range(name))\n',
       "")]),
    ("perf", PERF, "NVTX ranges pushed and never popped", 44,
     [("        ranges.enter_context(torch.cuda.nvtx.range(name))\n",
       "        torch.cuda.nvtx.range_push(name)\n")]),
    ("perf", PERF, "NVTX instead of record_function on a GPU", 44,
     [("    ranges.enter_context(record_function(name))\n"
       '    if device.type == "cuda":\n        ranges.enter_context(torch.cuda.nvtx.range(name))\n',
       '    if device.type == "cuda":\n        ranges.enter_context(torch.cuda.nvtx.range(name))\n'
       "    else:\n        ranges.enter_context(record_function(name))\n")]),
    ("perf", PERF, "set_precision's answer not kept (auto stays auto)", 45,
     [("args.precision = set_precision(args.precision, device)",
       "set_precision(args.precision, device)")]),
    ("perf", PERF, "auto taken for fp32", 45,
     [("args.precision = set_precision(args.precision, device)",
       'args.precision = set_precision("fp32" if args.precision == "auto" else args.precision, '
       "device)")]),
    ("perf", PERF, "fused when the device equals the string 'cuda'", 46,
     [('fused=device.type == "cuda")', 'fused=device == "cuda")')]),
    ("perf", PERF, "fused only with --device cuda", 46,
     [('fused=device.type == "cuda")', 'fused=args.device == "cuda")')]),
    ("perf", PERF, "no profiler.step", 43,
     [("            if profiler is not None:\n                profiler.step()\n", "")]),
    ("perf", PERF, "no operator table", 43,
     [("        print0(profiler.key_averages().table(sort_by=sort_by, row_limit=12))\n", "")]),
    ("perf", PERF, "the full window for a one-step run", 43,
     [("    window = profiler_window(steps_available)\n",
       "    window = (PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE)\n")]),
    ("perf", PERF, "no range around backward", 44,
     [('            with annotate("backward", device):\n                loss.backward()',
       "            loss.backward()")]),
    ("perf", PERF, "NVTX ranges only", 44,
     [("    ranges.enter_context(record_function(name))\n", "")]),
    ("perf", PERF, "bf16 without autocast", 45,
     [('with annotate("forward", device), autocast(args.precision, device):',
       'with annotate("forward", device):')]),
    ("perf", PERF, "the weights cast to bf16", 45,
     [('with annotate("forward", device), autocast(args.precision, device):',
       'with annotate("forward", device):'),
      ("    if world_size > 1:\n        model = DDP(model,", "    if args.precision == \"bf16\":\n"
       "        model = model.to(torch.bfloat16)\n    if world_size > 1:\n        model = DDP(model,")]),
    ("perf", PERF, "precision still fp32", 45,
     [("args.precision = set_precision(args.precision, device)",
       'args.precision = set_precision("fp32", device)')]),
    ("perf", PERF, "AdamW not fused", 46,
     [(',\n                                  fused=device.type == "cuda")', ")")]),
    ("perf", PERF, "foreach taken for fused", 46,
     [('fused=device.type == "cuda")', 'foreach=device.type == "cuda")')]),
    ("perf", PERF, "compiled without --compile", 47,
     [("    if args.compile:\n        compile_blocks(model)\n", "    compile_blocks(model)\n")]),
    ("perf", PERF, "the wrapped model compiled out of place", 47,
     [("    if args.compile:\n        compile_blocks(model)\n", ""),
      ("        model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)\n",
       "        model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)\n"
       "    if args.compile:\n        model = torch.compile(model)\n")]),
    ("perf", PERF, "the steps looked for under their trace name", 59,
     [('e.key.startswith("ProfilerStep") and', 'e.key.startswith("ProfilerStep#") and')]),
    ("perf", PERF, "GPU time summed with the operators inside each other", 59,
     [("    kernels_us = sum(e.self_device_time_total for e in events\n"
       "                     if e.device_type != DeviceType.CPU and not e.is_user_annotation)\n",
       "    kernels_us = sum(e.device_time_total for e in events)\n")]),
    ("perf", PERF, "every row's self device time summed (each kernel twice, the GPU's ranges too)", 59,
     [("    kernels_us = sum(e.self_device_time_total for e in events\n"
       "                     if e.device_type != DeviceType.CPU and not e.is_user_annotation)\n",
       "    kernels_us = sum(e.self_device_time_total for e in events)\n")]),
    ("perf", PERF, "the CPU operators' rows and the kernels' rows summed (each kernel twice)", 59,
     [("                     if e.device_type != DeviceType.CPU and not e.is_user_annotation)\n",
       "                     if not e.is_user_annotation)\n")]),
    ("perf", PERF, "the GPU's ranges summed with the kernels", 59,
     [("                     if e.device_type != DeviceType.CPU and not e.is_user_annotation)\n",
       "                     if e.device_type != DeviceType.CPU)\n")]),
    ("perf", PERF, "the steps counted in the GPU's ProfilerStep* row too", 59,
     [('e.key.startswith("ProfilerStep") and e.device_type == DeviceType.CPU]',
       'e.key.startswith("ProfilerStep")]')]),
    ("perf", PERF, "GPU busy of the whole profile, not per step", 59,
     [("    return kernels_us / n / 1e3, step_us / n / 1e3",
       "    return kernels_us / 1e3, step_us / 1e3")]),
    ("perf", PERF, "the steps counted by rows, not by their count", 59,
     [("    n = max(sum(e.count for e in steps), 1)", "    n = max(len(steps), 1)")]),
    ("perf", PERF, "the vocabulary rounded down", 60,
     [("    return -(-vocab_size // multiple) * multiple",
       "    return vocab_size // multiple * multiple")]),
    ("perf", PERF, "padding without its option", 60,
     [('    parser.add_argument("--pad-vocab", type=positive_int, default=64, metavar="N",\n'
       '                        help="round the vocabulary up to a multiple of N (1: no padding)")\n',
       ""),
      ("padded_vocab(corpus.vocab_size, args.pad_vocab)", "padded_vocab(corpus.vocab_size, 64)")]),
    ("perf", PERF, "one more multiple than needed", 60,
     [("    return -(-vocab_size // multiple) * multiple",
       "    return (vocab_size // multiple + 1) * multiple")]),
    ("perf", PERF, "the rate in tokens per millisecond", 42,
     [("rate = interval_tokens / (time.perf_counter() - interval_start)",
       "rate = interval_tokens / ((time.perf_counter() - interval_start) * 1000)")]),
    ("perf", PERF, "sequences counted, not tokens", 42,
     [("            interval_tokens += x.numel() * world_size",
       "            interval_tokens += len(x) * world_size")]),
    ("perf", PERF, "the interval's clock restarted inside every step", 42,
     [("            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n",
       "            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n"
       "            interval_start = time.perf_counter()\n")]),
    # at --log-every 1 this clock misses only the wait for each batch: the stand-in GPU run's
    # reports two steps apart show it (2 steps' tokens over about 1 step's time)
    ("perf", PERF, "the interval's clock started at the top of every step", 42,
     [("                break\n            x, y = x.to(device, non_blocking=True)",
       "                break\n            interval_start = time.perf_counter()\n"
       "            x, y = x.to(device, non_blocking=True)")]),
    ("perf", PERF, "the peak printed in GFLOP/s under TFLOP/s", 42,
     [('print0(f"MFU against {peak / 1e12:.3g} TFLOP/s', 'print0(f"MFU against {peak / 1e9:.3g} TFLOP/s')]),
    ("perf", PERF, "gpu_busy in microseconds", 59,
     [("    return kernels_us / n / 1e3, step_us / n / 1e3", "    return kernels_us / n, step_us / n")]),
    ("perf", PERF, "gpu_busy's two numbers swapped", 59,
     [("    return kernels_us / n / 1e3, step_us / n / 1e3",
       "    return step_us / n / 1e3, kernels_us / n / 1e3")]),
    ("perf", PERF, "gpu_busy divides by PROFILE_ACTIVE, not the steps counted", 59,
     [("    n = max(sum(e.count for e in steps), 1)\n", "    n = PROFILE_ACTIVE\n")]),
    ("perf", PERF, "traces written into OUT_DIR itself", 43,
     [('on_trace_ready=tensorboard_trace_handler(str(out_dir / "profile"),',
       "on_trace_ready=tensorboard_trace_handler(str(out_dir),")]),
    ("perf", PERF, "--compile-mode compiles without --compile", 63,
     [('    if args.compile and args.compile_mode not in (None, "default"):',
       '    if args.compile_mode not in (None, "default"):')]),
    ("perf", PERF, "a profiler schedule without repeat=1 (a trace every cycle)", 43,
     [("schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1)",
       "schedule=schedule(wait=wait, warmup=warmup, active=active)")]),
    ("perf", PERF, "traces not named after their rank", 43,
     [('on_trace_ready=tensorboard_trace_handler(str(out_dir / "profile"),\n'
       '                                                            worker_name=f"rank{rank}"))',
       'on_trace_ready=tensorboard_trace_handler(str(out_dir / "profile")))')]),
    ("perf", PERF, "the profiler's window from every epoch's steps, --max-steps left out", 43,
     [("    if args.max_steps is not None:\n        steps_available = min(steps_available, args.max_steps)\n",
       "")]),
    ("perf", PERF, "the rate of one step's tokens over the whole interval", 42,
     [("rate = interval_tokens / (time.perf_counter() - interval_start)",
       "rate = x.numel() * world_size / (time.perf_counter() - interval_start)")]),
    ("perf", PERF, "MFU multiplied by 100 and printed with %", 42,
     [("MFU {rate * flops_per_tok / (peak * world_size):.1%}",
       "MFU {100 * rate * flops_per_tok / (peak * world_size):.1%}")]),
    ("perf", PERF, "a vocabulary that is a multiple padded by one more", 60,
     [("    return -(-vocab_size // multiple) * multiple",
       "    return vocab_size + (multiple - vocab_size % multiple)")]),
    ("perf", PERF, "the step's time from its self CPU time", 59,
     [("    step_us = sum(e.cpu_time_total for e in steps)",
       "    step_us = sum(e.self_cpu_time_total for e in steps)")]),
    ("perf", PERF, "gpu_busy whenever --profile is given (a short run has no profiler)", 59,
     [("    if profiler is not None:\n        kernels_ms, step_ms = gpu_busy(profiler)\n",
       "    if args.profile:\n        kernels_ms, step_ms = gpu_busy(profiler)\n")]),
    ("perf", PERF, "DDP only where a node runs several processes", 62,
     [("import contextlib\n", "import contextlib\nimport os\n"),
      ("    if world_size > 1:\n        model = DDP(",
       '    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:\n        model = DDP(')]),
    ("perf", PERF, "the loss compiled without --compile", 61,
     [("    loss_fn = torch.compile(lm_loss) if args.compile else lm_loss\n",
       "    loss_fn = torch.compile(lm_loss)\n")]),
    ("perf", PERF, "the compiled loss never used", 61,
     [("    loss_fn = torch.compile(lm_loss) if args.compile else lm_loss\n",
       "    loss_fn = lm_loss\n    if args.compile:\n        torch.compile(F.cross_entropy)\n")]),
    ("perf", PERF, "the step still calls cross_entropy itself", 61,
     [("                loss = loss_fn(logits, y)\n",
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n")]),
    ("perf", PERF, "CUDA graphs for the blocks only", 63,
     [("        loss_fn = torch.compile(lm_loss, mode=args.compile_mode)\n", "")]),
    ("perf", PERF, "the mode of the lesson written in", 63,
     [("        compile_blocks(model, args.compile_mode)\n"
       "        loss_fn = torch.compile(lm_loss, mode=args.compile_mode)\n",
       "        compile_blocks(model, \"reduce-overhead\")\n"
       "        loss_fn = torch.compile(lm_loss, mode=\"reduce-overhead\")\n")]),
    ("perf", PERF, "--compile-mode passed on for reduce-overhead alone", 63,
     [("    if args.compile and args.compile_mode not in (None, \"default\"):\n",
       "    if args.compile and args.compile_mode == \"reduce-overhead\":\n")]),
    ("perf", PERF, "--compile-mode never passed on", 63,
     [("    if args.compile and args.compile_mode not in (None, \"default\"):\n"
       "        compile_blocks(model, args.compile_mode)\n"
       "        loss_fn = torch.compile(lm_loss, mode=args.compile_mode)\n", "")]),
    ("perf", PERF, "DDP dropped for every world size", 62,
     [("    if world_size > 1:\n        model = DDP(", "    if False:\n        model = DDP(")]),
    ("perf", PERF, "DDP only where the node has several GPUs", 62,
     [("    if world_size > 1:\n        model = DDP(",
       "    if torch.cuda.device_count() > 1:\n        model = DDP(")]),
    ("perf", PERF, "DDP kept for one process", 62,
     [("    if world_size > 1:\n        model = DDP(", "    if world_size >= 1:\n        model = DDP(")]),
    ("perf", PERF, 'torch.cuda.synchronize() with no device test', 42,
     [
      ('                synchronize(device)\n',
       '                torch.cuda.synchronize()\n')]),
    ("perf", PERF, 'tokens/s per rank, MFU per device (right)', 42,
     [
      ('            interval_tokens += x.numel() * world_size',
       '            interval_tokens += x.numel()'),
      ('MFU {rate * flops_per_tok / (peak * world_size):.1%}',
       'MFU {rate * flops_per_tok / peak:.1%}')]),
    ("perf", PERF, 'the interval clock started once, before the epochs (evaluation counted)', 42,
     [
      ('    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan\n',
       '    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan\n    interval_tokens, interval_start = 0, time.perf_counter()\n'),
      ('        # DONE 42: tokens since the last report, and when that interval started\n        interval_tokens, interval_start = 0, time.perf_counter()\n',
       '        # DONE 42: tokens since the last report, and when that interval started\n')]),
    ("perf", PERF, 'tokens/s cumulative since the epoch began (no reset after a report)', 42,
     [
      ('                interval_tokens, interval_start = 0, time.perf_counter()\n',
       '')]),
    ("perf", PERF, 'fp16 autocast (no GradScaler) for the bf16 run', 45,
     [
      ('with annotate("forward", device), autocast(args.precision, device):',
       'with annotate("forward", device), torch.autocast(device.type, dtype=torch.float16, enabled=args.precision == "bf16"):')]),
    ("perf", PERF, "MFU's FLOPs per token from all parameters (the embedding tables counted)", 42,
     [("flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,",
       "flops_per_token(model.num_params(), cfg.n_layers,")]),
    ("perf", PERF, "FLOPs per token written out from all parameters", 42,
     [("    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,\n"
       "                                    cfg.d_model, cfg.max_seq_len)\n",
       "    flops_per_tok = 6 * model.num_params() + 12 * cfg.n_layers * cfg.d_model * cfg.max_seq_len\n")]),
    ("perf", PERF, "the output projection left out of the FLOPs too (as if tied to the embedding)", 42,
     [("flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,",
       "flops_per_token(model.num_params(exclude_embeddings=True) - model.output.weight.numel(),\n"
       "                                    cfg.n_layers,")]),
    ("perf", PERF, "the whole profiling window for every run of 2 steps or more", 43,
     [("        return 0, 1, steps_available - 1\n",
       "        return PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE\n")]),
    ("perf", PERF, "only the active steps shrunk for a short run", 43,
     [("        return 0, 1, steps_available - 1\n",
       "        return PROFILE_WAIT, PROFILE_WARMUP, min(PROFILE_ACTIVE, steps_available - 1)\n")]),
    ("perf", PERF, "the active steps without min() (a long run records every step)", 43,
     [("        return PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE\n",
       "        return PROFILE_WAIT, PROFILE_WARMUP, steps_available - PROFILE_WAIT - PROFILE_WARMUP\n")]),
    # (the self-check's red team, 2026-11-28)
    ("perf", PERF, "FLOPs per token as 6 x all parameters (the embedding tables counted)", 42,
     [("    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,\n"
       "                                    cfg.d_model, cfg.max_seq_len)\n",
       "    flops_per_tok = 6 * model.num_params()\n")]),
    ("perf", PERF, "MFU of the step line from all parameters' FLOPs of its own", 42,
     [("    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,\n"
       "                                    cfg.d_model, cfg.max_seq_len)\n",
       "    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,\n"
       "                                    cfg.d_model, cfg.max_seq_len)\n"
       "    flops_all = flops_per_token(model.num_params(), cfg.n_layers, cfg.d_model,\n"
       "                                cfg.max_seq_len)  # for MFU\n"),
      ('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       "                mfu = rate * flops_all / (peak * world_size)\n"
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {mfu:.2%}")\n')]),
    ("perf", PERF, "MFU divided by the peak in TFLOP/s", 42,
     [('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak / 1e12 * world_size):.1%}")\n')]),
    ("perf", PERF, "tokens/s over the steps' own time (data loading and logging left out)", 42,
     [("        interval_tokens, interval_start = 0, time.perf_counter()\n"
       "        for x, y",
       "        interval_tokens, interval_start, busy = 0, time.perf_counter(), 0.0\n"
       "        for x, y"),
      ("            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n",
       "            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n"
       "            t0 = time.perf_counter()\n"),
      ("            step += 1\n"
       "            throughput.step",
       "            synchronize(device)\n"
       "            busy += time.perf_counter() - t0\n"
       "            step += 1\n"
       "            throughput.step"),
      ("                rate = interval_tokens / (time.perf_counter() - interval_start)\n",
       "                rate = interval_tokens / busy\n"),
      ("                interval_tokens, interval_start = 0, time.perf_counter()\n"
       '                print0(f"epoch {epoch} {monitor',
       "                interval_tokens, interval_start, busy = 0, time.perf_counter(), 0.0\n"
       '                print0(f"epoch {epoch} {monitor')]),
    ("perf", PERF, "a short run's window one step too long", 43,
     [("        return 0, 1, steps_available - 1\n",
       "        return 0, 1, steps_available\n")]),
    ("perf", PERF, "a run too short to profile says nothing", 43,
     [('        print0(f"--profile: only {steps_available} training step(s), too few to profile: "\n'
       '               "run at least 2 (--max-steps)")\n',
       "")]),
    ("perf", PERF, "NVTX ranges on every device (a CPU has none)", 44,
     [('    if device.type == "cuda":\n'
       "        ranges.enter_context(torch.cuda.nvtx.range(name))\n",
       "    ranges.enter_context(torch.cuda.nvtx.range(name))\n")]),
    ("perf", PERF, "NVTX ranges started and never ended", 44,
     [("        ranges.enter_context(torch.cuda.nvtx.range(name))\n",
       "        torch.cuda.nvtx.range_start(name)\n")]),
    ("perf", PERF, "MFU's FLOPs per token as 6 N, without the attention's 12 L d T", 42,
     [('    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,\n                                    cfg.d_model, cfg.max_seq_len)\n',
       '    flops_per_tok = 6 * model.num_params(exclude_embeddings=True)\n')]),
    ("perf", PERF, "the interval's tokens never set back, its clock is", 42,
     [('                interval_tokens, interval_start = 0, time.perf_counter()\n',
       '                interval_start = time.perf_counter()\n')]),
    ("perf", PERF, "the rate read from the course monitor's throughput.tokens_per_s()", 42,
     [('                rate = interval_tokens / (time.perf_counter() - interval_start)\n',
       '                rate = throughput.tokens_per_s()\n')]),
    ("perf", PERF, "the interval's tokens counted as log_every steps", 42,
     [('            interval_tokens += x.numel() * world_size\n',
       ''),
      ('                rate = interval_tokens / (time.perf_counter() - interval_start)\n',
       '                interval_tokens = args.log_every * x.numel() * world_size\n                rate = interval_tokens / (time.perf_counter() - interval_start)\n')]),
    ("perf", PERF, 'the profiler stepped again in the report block', 43,
     [('                interval_tokens, interval_start = 0, time.perf_counter()\n',
       '                interval_tokens, interval_start = 0, time.perf_counter()\n                if profiler is not None:\n                    profiler.step()\n')]),
    ("perf", PERF, "the profiler stopped at every epoch's end", 43,
     [('        throughput.pause()  # evaluation time is not training time\n',
       '        throughput.pause()  # evaluation time is not training time\n        if profiler is not None:\n            profiler.stop()\n'),
      ('    if profiler is not None:\n        profiler.stop()\n',
       '    if profiler is not None:\n')]),
    ("perf", PERF, 'the validation loss computed under autocast', 45,
     [('        val_loss = evaluate(model, val_loader, device)\n',
       '        with autocast(args.precision, device):\n            val_loss = evaluate(model, val_loader, device)\n')]),
    ("perf", PERF, 'the whole model compiled in place (model.compile())', 47,
     [('    if args.compile:\n        compile_blocks(model)\n',
       '    if args.compile:\n        model.compile()\n')]),
    ("perf", PERF, 'each block compiled into a loop variable', 47,
     [('    if args.compile:\n        compile_blocks(model)\n',
       '    if args.compile:\n        for block in model.layers.values():\n            block = torch.compile(block)\n')]),
    ("perf", PERF, "the loss compiled with mode='reduce-overhead' at TODO 61", 61,
     [('    loss_fn = torch.compile(lm_loss) if args.compile else lm_loss\n',
       '    loss_fn = torch.compile(lm_loss, mode="reduce-overhead") if args.compile else lm_loss\n')]),
    ("perf", PERF, '--compile-mode defaulting to reduce-overhead', 63,
     [('    parser.add_argument("--compile-mode", default=None,',
       '    parser.add_argument("--compile-mode", default="reduce-overhead",')]),
    ("perf", PERF, "the GPU's operator table sorted by device_time_total", 43,
     [('sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"',
       'sort_by = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"')]),
    ("perf", PERF, "the CPU's operator table sorted by cpu_time_total", 43,
     [('sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"',
       'sort_by = "self_device_time_total" if device.type == "cuda" else "cpu_time_total"')]),
    # ---- the performance job file ------------------------------------------------------
    ("perf-sbatch", PERF_SBATCH, "nsys on every run", 48,
     [('if [ "${NSYS:-0}" = 1 ]; then', "if true; then")]),
    ("perf-sbatch", PERF_SBATCH, "nsys without the NVTX ranges", 48,
     [("${NSYS_TRACE:-cuda,nvtx,nccl}", "${NSYS_TRACE:-cuda}")]),
    ("perf-sbatch", PERF_SBATCH, "nsys without --force-overwrite", 48,
     [(" --force-overwrite=true", "")]),
    ("perf-sbatch", PERF_SBATCH, "the report in the submit folder", 48,
     [('-o "$OUT_DIR/nsys"', "-o nsys")]),
    ("perf-sbatch", PERF_SBATCH, 'PROFILER as one string', 48,
     [
      ('    PROFILER=(nsys profile -t "${NSYS_TRACE:-cuda,nvtx,nccl}" -o "$OUT_DIR/nsys" --force-overwrite=true)',
       '    PROFILER="nsys profile -t ${NSYS_TRACE:-cuda,nvtx,nccl} -o $OUT_DIR/nsys --force-overwrite=true"')]),
    ("perf-sbatch", PERF_SBATCH, 'nsys put before srun (profiles srun, not the training)', 48,
     [
      ('srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" \\\n    "${PROFILER[@]}" python -u',
       '"${PROFILER[@]}" srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" \\\n    python -u')]),
    # ---- collectives (issue 20) --------------------------------------------------------
    ("collectives", COLL, "the ring turned the wrong way round", 49,
     [("right, left = (rank + 1) % n, (rank - 1) % n", "right, left = (rank - 1) % n, (rank + 1) % n")]),
    ("collectives", COLL, "a blocking send before the receive", 49,
     [("    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),\n"
       "                                       dist.P2POp(dist.irecv, recv, left)])\n"
       "    for request in requests:\n        request.wait()\n",
       "    dist.send(send, right)\n    dist.recv(recv, left)\n")]),
    ("collectives", COLL, "the send's request never waited for", 49,
     [("    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),\n"
       "                                       dist.P2POp(dist.irecv, recv, left)])\n"
       "    for request in requests:\n        request.wait()\n",
       "    dist.isend(send, right)\n    dist.irecv(recv, left).wait()\n")]),
    ("collectives", COLL, "only the last request of batch_isend_irecv waited for", 49,
     [("    for request in requests:\n        request.wait()\n",
       "    requests[-1].wait()  # the receive is what we need\n")]),
    ("collectives", COLL, "the neighbours without % n (rank n - 1 sends to rank n)", 49,
     [("right, left = (rank + 1) % n, (rank - 1) % n", "right, left = rank + 1, rank - 1")]),
    ("collectives", COLL, "the reduce-scatter makes n steps, not n - 1", 50,
     [("    for step in range(n - 1):\n        send, into = (rank - step) % n",
       "    for step in range(n):\n        send, into = (rank - step) % n")]),
    ("collectives", COLL, "the reduce-scatter's steps counted from 1 (one step off)", 50,
     [("    for step in range(n - 1):\n        send, into = (rank - step) % n",
       "    for step in range(1, n):\n        send, into = (rank - step) % n")]),
    ("collectives", COLL, "the received chunk added into the chunk sent", 50,
     [("        chunks[into] += received\n", "        chunks[send] += received\n")]),
    ("collectives", COLL, "the reduce-scatter averages (divides its chunk by n)", 50,
     [("        chunks[into] += received\n",
       "        chunks[into] += received\n    chunks[(rank + 1) % n] /= n  # average, like DDP\n")]),
    ("collectives", COLL, "the receive buffer sized like the chunk sent", 50,
     [("        received = torch.empty_like(chunks[into])",
       "        received = torch.empty_like(chunks[send])")]),
    ("collectives", COLL, "the receive buffer float32 for float64 chunks", 50,
     [("        received = torch.empty_like(chunks[into])",
       "        received = torch.zeros(chunks[into].shape)")]),
    ("collectives", COLL, "the sum kept in the list, not in the tensor", 50,
     [("chunks[into] += received", "chunks[into] = chunks[into] + received")]),
    ("collectives", COLL, "the received chunk overwrites instead of adding", 50,
     [("        received = torch.empty_like(chunks[into])\n"
       "        send_right_receive_left(chunks[send], received)\n"
       "        chunks[into] += received\n",
       "        send_right_receive_left(chunks[send], chunks[into])\n")]),
    ("collectives", COLL, "the all-gather with the reduce-scatter's indices", 51,
     [("send, into = (rank + 1 - step) % n, (rank - step) % n",
       "send, into = (rank - step) % n, (rank - step - 1) % n")]),
    ("collectives", COLL, "the all-gather adds what it receives", 51,
     [("        send_right_receive_left(chunks[send], chunks[into])\n",
       "        received = torch.empty_like(chunks[into])\n"
       "        send_right_receive_left(chunks[send], received)\n"
       "        chunks[into] += received\n")]),
    ("collectives", COLL, "the all-gather assigns a new buffer to the list", 51,
     [("        send_right_receive_left(chunks[send], chunks[into])\n",
       "        received = torch.empty_like(chunks[into])\n"
       "        send_right_receive_left(chunks[send], received)\n"
       "        chunks[into] = received\n")]),
    ("collectives", COLL, "rank 0 makes one all-gather step fewer", 51,
     [("    for step in range(n - 1):\n        send, into = (rank + 1 - step) % n, (rank - step) % n",
       "    for step in range(n - 1 if rank else n - 2):\n"
       "        send, into = (rank + 1 - step) % n, (rank - step) % n")]),
    ("collectives", COLL, "the latency returned in milliseconds", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "return latency * 1e3, (1 / slope) * 2 * (world_size - 1) / world_size")]),
    ("collectives", COLL, "the bus bandwidth in bits per second", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "return latency, 8 / slope * 2 * (world_size - 1) / world_size")]),
    ("collectives", COLL, "the algorithm bandwidth returned as bus bandwidth", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "return latency, 1 / slope")]),
    ("collectives", COLL, "all-gather's bus factor for an all-reduce", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "return latency, (1 / slope) * (world_size - 1) / world_size")]),
    ("collectives", COLL, "the fit returns (busbw, latency)", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "return (1 / slope) * 2 * (world_size - 1) / world_size, latency")]),
    ("collectives", COLL, "the fit asks dist.get_world_size() (not its argument)", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "n = dist.get_world_size()\n    return latency, (1 / slope) * 2 * (n - 1) / n")]),
    ("collectives", COLL, "the bus factor by integer division (2 * (n - 1) // n is 1)", 52,
     [("return latency, (1 / slope) * 2 * (world_size - 1) / world_size",
       "return latency, (1 / slope) * (2 * (world_size - 1) // world_size)")]),
    ("collectives", COLL, "a line through the first and the last point", 52,
     [("""    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True))
             / sum((x - mean_x) ** 2 for x in sizes))
    latency = mean_y - slope * mean_x
""", """    slope = (seconds[-1] - seconds[0]) / (sizes[-1] - sizes[0])
    latency = seconds[0] - slope * sizes[0]
""")]),
    ("collectives", COLL, "the small messages left out of the fit", 52,
     [("    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)\n",
       "    sizes, seconds = sizes[len(sizes) // 2:], seconds[len(seconds) // 2:]  # bandwidth-bound\n"
       "    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)\n")]),
    ("collectives", COLL, "the ring's 2 (n - 1) / n forgotten", 53,
     [("latency + nbytes * factor / busbw", "latency + nbytes / busbw")]),
    ("collectives", COLL, "all-gather's factor for DDP's all-reduce", 53,
     [("    factor = 2 * (world_size - 1) / world_size\n    return sum(",
       "    factor = (world_size - 1) / world_size\n    return sum(")]),
    ("collectives", COLL, "one latency per step, not per bucket", 53,
     [("return sum(latency + nbytes * factor / busbw for nbytes in buckets)",
       "return latency + sum(nbytes * factor / busbw for nbytes in buckets)")]),
    ("collectives", COLL, "the launches counted instead of gloo's all-reduces", 54,
     [("""    gloo = [e for e in events if e.get("cat") == "user_annotation"
            and e.get("name") == "gloo:all_reduce"]""",
       """    gloo = [e for e in events if e.get("name") == "c10d::allreduce_"]""")]),
    ("collectives", COLL, "the all-reduce time of all steps together", 54,
     [("return sum(e[\"dur\"] for e in kernels or gloo) / 1e6 / steps",
       "return sum(e[\"dur\"] for e in kernels or gloo) / 1e6")]),
    ("collectives", COLL, "the GPU copies of the step ranges counted too", 54,
     [("""    steps = sum(1 for e in events if e.get("cat") == "user_annotation"
                and e.get("name", "").startswith("ProfilerStep#"))""",
       """    steps = sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#"))""")]),
    ("collectives", COLL, "every step range and every event named all_reduce counted", 54,
     [("""    steps = sum(1 for e in events if e.get("cat") == "user_annotation"
                and e.get("name", "").startswith("ProfilerStep#"))""",
       """    steps = sum(1 for e in events if e.get("name", "").startswith("ProfilerStep#"))"""),
      ("""    kernels = [e for e in events if e.get("cat") == "kernel" and "AllReduce" in e.get("name", "")]""",
       """    kernels = [e for e in events if "AllReduce" in e.get("name", "")
               or "all_reduce" in e.get("name", "")]""")]),
    ("collectives", COLL, "the trace's events indexed e[\"cat\"] (metadata events have none)", 54,
     [('kernels = [e for e in events if e.get("cat") == "kernel" and "AllReduce" in e.get("name", "")]',
       'kernels = [e for e in events if e["cat"] == "kernel" and "AllReduce" in e["name"]]')]),
    # ---- memory ------------------------------------------------------------------------
    ("memory", MEM, "the whole model checkpointed as one piece", 55,
     [("    for name in list(model.layers):\n"
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])\n"
       "    return model",
       "    return checkpoint_wrapper(model)")]),
    ("memory", MEM, "only the MLP of each block checkpointed", 55,
     [("        model.layers[name] = checkpoint_wrapper(model.layers[name])",
       "        model.layers[name].mlp = checkpoint_wrapper(model.layers[name].mlp)")]),
    ("memory", MEM, "the wrapped blocks not put back", 55,
     [("        model.layers[name] = checkpoint_wrapper(model.layers[name])",
       "        checkpoint_wrapper(model.layers[name])")]),
    ("memory", MEM, "only the first block checkpointed", 55,
     [("    for name in list(model.layers):\n",
       "    for name in list(model.layers)[:1]:\n")]),
    ("memory", MEM, "the reentrant checkpointing", 55,
     [("        model.layers[name] = checkpoint_wrapper(model.layers[name])",
       "        model.layers[name] = checkpoint_wrapper(model.layers[name], "
       "checkpoint_impl=CheckpointImpl.REENTRANT)"),
      ("import checkpoint_wrapper\n", "import CheckpointImpl, checkpoint_wrapper\n")]),
    ("memory", MEM, "zero2 reshards after forward too", 56,
     [('options = dict(reshard_after_forward=layout != "zero2")',
       "options = dict(reshard_after_forward=True)")]),
    ("memory", MEM, "offload without CPUOffloadPolicy", 56,
     [('        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())',
       "        pass")]),
    ("memory", MEM, "offload keeps the gathered weights", 56,
     [('options = dict(reshard_after_forward=layout != "zero2")',
       'options = dict(reshard_after_forward=layout == "zero3")')]),
    ("memory", MEM, "each block's attention and MLP sharded instead of the block", 56,
     [("    for block in model.layers.values():\n        fully_shard(block, **options)\n",
       "    for block in model.layers.values():\n        fully_shard(block.attn, **options)\n"
       "        fully_shard(block.mlp, **options)\n")]),
    ("memory", MEM, "only the root sharded", 56,
     [("    for block in model.layers.values():\n        fully_shard(block, **options)\n", "")]),
    ("memory", MEM, "the ModuleDict of blocks sharded as one", 56,
     [("    for block in model.layers.values():\n        fully_shard(block, **options)\n",
       "    fully_shard(model.layers, **options)\n")]),
    ("memory", MEM, "the blocks sharded, the root left whole", 56,
     [("    fully_shard(model, **{k: v for k, v in options.items() if k != \"reshard_after_forward\"})\n",
       "")]),
    ("memory", MEM, "only the blocks offloaded, the root kept on the device", 56,
     [("    fully_shard(model, **{k: v for k, v in options.items() if k != \"reshard_after_forward\"})\n",
       "    fully_shard(model)\n")]),
    ("memory", MEM, "only the root offloaded, the blocks kept on the device", 56,
     [("        fully_shard(block, **options)\n",
       '        fully_shard(block, reshard_after_forward=options["reshard_after_forward"])\n')]),
    ("memory", MEM, "zero3 keeps the gathered weights as zero2 does", 56,
     [('options = dict(reshard_after_forward=layout != "zero2")',
       'options = dict(reshard_after_forward=layout == "offload")')]),
    ("memory", MEM, "offload's host memory never pinned on a GPU", 56,
     [("CPUOffloadPolicy(pin_memory=torch.cuda.is_available())",
       "CPUOffloadPolicy(pin_memory=False)")]),
    ("memory", MEM, "offload pins host memory on a machine without a GPU too", 56,
     [("CPUOffloadPolicy(pin_memory=torch.cuda.is_available())", "CPUOffloadPolicy()")]),
    ("memory", MEM, "ZeroRedundancyOptimizer of SGD", 57,
     [("optimizer_class=torch.optim.AdamW,\n", "optimizer_class=torch.optim.SGD,\n")]),
    ("memory", MEM, "zero1 left with a plain AdamW", 57,
     [('    if args.layout == "zero1":\n        optimizer = ZeroRedundancyOptimizer(',
       '    if args.layout == "zero-1":\n        optimizer = ZeroRedundancyOptimizer(')]),
    ("memory", MEM, "ZeroRedundancyOptimizer without AdamW's arguments", 57,
     [("optimizer_class=torch.optim.AdamW,\n                                            **adamw)",
       "optimizer_class=torch.optim.AdamW)")]),
    ("memory", MEM, "ZeroRedundancyOptimizer for the ddp layout too", 57,
     [('    if args.layout == "zero1":\n        optimizer = ZeroRedundancyOptimizer(',
       '    if args.layout in ("ddp", "zero1"):\n        optimizer = ZeroRedundancyOptimizer(')]),
    ("memory", MEM, "the loss not divided by the micro-batches", 58,
     [("F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum",
       "F.cross_entropy(logits.flatten(0, 1), y.flatten())")]),
    ("memory", MEM, "only the logged loss divided, backward on the whole", 58,
     [("                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "                loss.backward()\n",
       "                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                loss.backward()\n"
       "                loss = loss / args.grad_accum\n")]),
    ("memory", MEM, "no no_sync: an all-reduce every micro-batch", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with contextlib.nullcontext():")]),
    ("memory", MEM, "no_sync on the last micro-batch instead of the others", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with no_gradient_sync(model) if last else contextlib.nullcontext():")]),
    ("memory", MEM, "the forward outside no_sync, as the wording 'backward inside' reads", 58,
     [("            with contextlib.nullcontext() if last else no_gradient_sync(model):\n"
       "                with autocast(args.precision, device):\n"
       "                    logits = model(x)\n"
       "                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "                loss.backward()\n",
       "            with autocast(args.precision, device):\n"
       "                logits = model(x)\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "            with contextlib.nullcontext() if last else no_gradient_sync(model):\n"
       "                loss.backward()\n")]),
    ("memory", MEM, "DDP's no_sync() called on every layout (FSDP2 has none)", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with contextlib.nullcontext() if last else model.no_sync():")]),
    ("memory", MEM, "optimizer.step() every micro-batch", 58,
     [("            if not last:\n                continue\n            optimizer.step()\n",
       "            optimizer.step()\n            if not last:\n                continue\n")]),
    ("memory", MEM, "zero_grad every micro-batch", 58,
     [("            if micro % args.grad_accum == 0:  # a new optimizer step begins\n"
       "                optimizer.zero_grad(set_to_none=True)\n",
       "            optimizer.zero_grad(set_to_none=True)\n")]),
    ("memory", MEM, "no_sync on rank 0 only", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with contextlib.nullcontext() if last or torch.distributed.get_rank() else "
       "no_gradient_sync(model):")]),
    ("memory", MEM, "the loss divided by the micro-batches and by the ranks", 58,
     [("F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum",
       "F.cross_entropy(logits.flatten(0, 1), y.flatten()) / (args.grad_accum * world_size)")]),
    ("memory", MEM, "divided by the micro-batches only under DDP", 58,
     [("F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum",
       "F.cross_entropy(logits.flatten(0, 1), y.flatten()) / (\n"
       "                        args.grad_accum if isinstance(model, DDP) else 1)")]),
    ("memory", MEM, "no_sync skipped for the FSDP layouts", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with contextlib.nullcontext() if last or not isinstance(model, DDP) else "
       "no_gradient_sync(model):")]),
    ("memory", MEM, "the logged loss undivided, backward on the divided loss", 58,
     [("                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "                loss.backward()\n",
       "                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                (loss / args.grad_accum).backward()\n")]),
    ("memory", MEM, "ZeroRedundancyOptimizer for the FSDP layouts too", 57,
     [('    if args.layout == "zero1":\n        optimizer = ZeroRedundancyOptimizer(',
       '    if args.layout != "ddp":\n        optimizer = ZeroRedundancyOptimizer(')]),
    ("memory", MEM, "offload_wrapper instead of checkpoint_wrapper", 55,
     [("import checkpoint_wrapper\n", "import checkpoint_wrapper, offload_wrapper\n"),
      ("        model.layers[name] = checkpoint_wrapper(model.layers[name])",
       "        model.layers[name] = offload_wrapper(model.layers[name])")]),
    ("memory", MEM, "the ModuleDict of blocks checkpoint-wrapped as one", 55,
     [("    for name in list(model.layers):\n"
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])\n",
       "    model.layers = checkpoint_wrapper(model.layers)\n")]),
    ("memory", MEM, "apply_activation_checkpointing returns nothing", 55,
     [("        model.layers[name] = checkpoint_wrapper(model.layers[name])\n    return model\n",
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])\n")]),
    ("memory", MEM, "apply_fsdp returns nothing", 56,
     [('if k != "reshard_after_forward"})\n    return model\n',
       'if k != "reshard_after_forward"})\n')]),
    ("memory", MEM, "the blocks' names checkpoint-wrapped", 55,
     [("    for name in list(model.layers):\n"
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])\n",
       "    for name in model.layers:\n"
       "        model.layers[name] = checkpoint_wrapper(name)\n")]),
    ("memory", MEM, "torch.utils.checkpoint.checkpoint as checkpoint_fn (reentrant)", 55,
     [("checkpoint_wrapper(model.layers[name])",
       "checkpoint_wrapper(model.layers[name], checkpoint_fn=torch.utils.checkpoint.checkpoint)"),
      ("import contextlib\n", "import contextlib\nimport torch.utils.checkpoint\n")]),
    ("memory", MEM, "the micro-batches' losses summed, one backward per step", 58,
     [("            with contextlib.nullcontext() if last else no_gradient_sync(model):\n"
       "                with autocast(args.precision, device):\n"
       "                    logits = model(x)\n"
       "                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "                loss.backward()\n",
       "            with autocast(args.precision, device):\n"
       "                logits = model(x)\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "            total = loss if micro % args.grad_accum == 1 or args.grad_accum == 1 "
       "else total + loss\n"
       "            if last:\n"
       "                total.backward()\n")]),
    ("memory", MEM, "the step's last micro-batch counted from the start (syncs once)", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with contextlib.nullcontext() if micro == args.grad_accum else no_gradient_sync(model):")]),
    ("memory", MEM, "the loss divided by the ranks instead of the micro-batches", 58,
     [("y.flatten()) / args.grad_accum", "y.flatten()) / world_size")]),
    ("memory", MEM, "ZeroRedundancyOptimizer overlapping with DDP", 57,
     [("optimizer_class=torch.optim.AdamW,\n                                            **adamw)",
       "optimizer_class=torch.optim.AdamW,\n"
       "                                            overlap_with_ddp=True, **adamw)")]),
    ("memory", MEM, "FSDP's gradient sync switched off and never on again", 58,
     [("    model.set_requires_gradient_sync(False)\n    try:\n        yield\n    finally:\n"
       "        model.set_requires_gradient_sync(True)\n",
       "    model.set_requires_gradient_sync(False)\n    yield\n")]),
    ("memory", MEM, "checkpoint_wrapper without the RNG state (dropout masks differ in recompute)",
     55, [("checkpoint_wrapper(model.layers[name])",
           "checkpoint_wrapper(model.layers[name], preserve_rng_state=False)")]),
    ("memory", MEM, "the backward outside no_gradient_sync", 58,
     [("                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "                loss.backward()\n",
       "                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n"
       "            loss.backward()\n")]),
    ("memory", MEM, "the divided loss divided again for backward", 58,
     [("                loss.backward()\n            micro_losses",
       "                (loss / args.grad_accum).backward()\n            micro_losses")]),
    ("memory", MEM, "the micro-batches counted from 1 (the first step runs one)", 58,
     [("loss_history, step, micro, val_loss = [], 0, 0, math.nan",
       "loss_history, step, micro, val_loss = [], 0, 1, math.nan")]),
    ("memory", MEM, "the logged loss the mean of the divided micro-batch losses", 58,
     [("torch.stack(micro_losses).sum()", "torch.stack(micro_losses).mean()")]),
    ("memory", MEM, "the step's last micro-batch counted one ahead", 58,
     [("last = micro % args.grad_accum == 0", "last = (micro + 1) % args.grad_accum == 0")]),
    ("memory", MEM, "FSDP's gradient sync switched off on the root only", 58,
     [("    model.set_requires_gradient_sync(False)\n",
       "    model.set_requires_gradient_sync(False, recurse=False)\n")]),
    ("memory", MEM, "DDP's no_sync() called, not entered", 58,
     [("        with model.no_sync():\n            yield\n",
       "        model.no_sync()\n        yield\n")]),
    ("memory", MEM, "tokens counted per micro-batch (grad_accum left out)", 58,
     [("throughput.step(x.numel() * world_size * args.grad_accum)",
       "throughput.step(x.numel() * world_size)")]),
    ("memory", MEM, "tokens counted on every micro-batch, each as a whole step", 58,
     [("            micro_losses.append(loss.detach())\n            if not last:\n                continue\n            optimizer.step()\n            step += 1\n            throughput.step(x.numel() * world_size * args.grad_accum)\n",
       "            micro_losses.append(loss.detach())\n            throughput.step(x.numel() * world_size * args.grad_accum)\n            if not last:\n                continue\n            optimizer.step()\n            step += 1\n")]),
    ("memory", MEM, "apply_fsdp checkpoints the blocks itself, whatever the flag says", 55,
     [('    options = dict(reshard_after_forward=layout != "zero2")\n',
       '    model = apply_activation_checkpointing(model)\n'
       '    options = dict(reshard_after_forward=layout != "zero2")\n')]),
    # ---- found by trying new mistakes on the check (2026-11-28) ---------------------------
    ("ddp", DDP, "the training sampler without the run's seed", 3,
     [("shuffle=True, seed=args.seed, drop_last=True)", "shuffle=True, drop_last=True)")]),
    ("ddp", DDP, "the training sampler left to its defaults for shuffle and seed", 3,
     [("shuffle=True, seed=args.seed, drop_last=True)", "drop_last=True)")]),
    ("ddp", DDP, "DistributedEvalSampler for the training split", 3,
     [("train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank,\n"
       "                                       shuffle=True, seed=args.seed, drop_last=True)",
       "train_sampler = DistributedEvalSampler(train_ds, num_replicas=world_size, rank=rank)")]),
    ("ddp", DDP, "the model wrapped in DDP twice", 5,
     [('model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)',
       'model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)\n'
       "    model = DDP(model)")]),
    ("ddp", DDP, "the loss averaged over the ranks before backward", 7,
     [("                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n",
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                loss = all_reduce_mean(loss)\n"),
      ("step_loss = all_reduce_mean(loss.detach())", "step_loss = loss.detach().clone()")]),
    ("fsdp", FSDP, "the sharded state dict torch.save-d on rank 0 as the final model", 22,
     [('    save_full_model(model, out_dir / "final_model.pt")',
       '    if rank == 0:\n        torch.save(model.state_dict(), out_dir / "final_model.pt")')]),
    ("fsdp", FSDP, "apply_fsdp called without the precision (its default: fp32)", 19,
     [('apply_fsdp(model, args.precision, args.reshard_after_forward == "true")',
       'apply_fsdp(model, reshard_after_forward=args.reshard_after_forward == "true")')]),
    ("fsdp", FSDP, "the checkpoints saved without the optimizer", 20,
     [('save_sharded_model(model, optimizer, out_dir / "checkpoints" / name, train_state)',
       'save_sharded_model(model, None, out_dir / "checkpoints" / name, train_state)')]),
    ("tp", TP, "the optimizer made before apply_tp and fully_shard", 29,
     [("    model = apply_tp(model, mesh[\"tp\"])\n",
       "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, "
       "weight_decay=args.weight_decay,\n"
       "                                  fused=device.type == \"cuda\")\n"
       "    model = apply_tp(model, mesh[\"tp\"])\n"),
      ("    fully_shard(model, mesh=mesh[\"dp\"])\n"
       "    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, "
       "weight_decay=args.weight_decay,\n"
       "                                  fused=device.type == \"cuda\")  # one kernel for all "
       "parameters\n",
       "    fully_shard(model, mesh=mesh[\"dp\"])\n")]),
    # ---- right for 2 micro-batches only: the check's runs accumulate 1, 2 and 4 ------------
    ("memory", MEM, "the step's last micro-batch every second one, a 2 written in", 58,
     [("last = micro % args.grad_accum == 0", "last = micro % 2 == 0")]),
    ("memory", MEM, "the step's last micro-batch any but the first (right for 2 only)", 58,
     [("last = micro % args.grad_accum == 0", "last = micro % args.grad_accum != 1")]),
    ("memory", MEM, "zero_grad every second micro-batch, a 2 written in", 58,
     [("if micro % args.grad_accum == 0:  # a new", "if micro % 2 == 0:  # a new")]),
    ("memory", MEM, "zero_grad before the first micro-batch only", 58,
     [("if micro % args.grad_accum == 0:  # a new", "if micro == 0:  # a new")]),
    ("memory", MEM, "tokens counted for 2 micro-batches, a 2 written in", 58,
     [("throughput.step(x.numel() * world_size * args.grad_accum)",
       "throughput.step(x.numel() * world_size * 2)")]),
    ("memory", MEM, "the sync switched on every second micro-batch, a 2 written in", 58,
     [("with contextlib.nullcontext() if last else no_gradient_sync(model):",
       "with contextlib.nullcontext() if micro % 2 == 0 else no_gradient_sync(model):")]),
    # ---- a third round on the DDP step (2026-11-28) -------------------------------------
    ("ddp", DDP, "DataParallel imported under the name DDP", 1,
     [("from torch.nn.parallel import DistributedDataParallel as DDP",
       "from torch.nn.parallel import DataParallel as DDP")]),
    ("ddp", DDP, "the batch per rank divided by the ranks", 4,
     [("loader_args = dict(batch_size=args.batch_size,",
       "loader_args = dict(batch_size=args.batch_size // world_size,")]),
    ("ddp", DDP, "backward on the loss divided by the ranks (DDP averages already)", 5,
     [("            loss.backward()\n", "            (loss / world_size).backward()\n")]),
    ("ddp", DDP, "forward and backward inside model.no_sync()", 5,
     [("            with autocast(args.precision, device):  # bf16 matmuls; the weights stay "
       "fp32\n                logits = model(x)\n                loss = F.cross_entropy("
       "logits.flatten(0, 1), y.flatten())\n            optimizer.zero_grad(set_to_none=True)\n"
       "            loss.backward()\n",
       "            with model.no_sync(), autocast(args.precision, device):\n"
       "                logits = model(x)\n                loss = F.cross_entropy("
       "logits.flatten(0, 1), y.flatten())\n                optimizer.zero_grad("
       "set_to_none=True)\n                loss.backward()\n")]),
    ("ddp", DDP, "set_epoch with the number of epochs", 6,
     [("train_sampler.set_epoch(epoch)", "train_sampler.set_epoch(args.epochs)")]),
    ("ddp", DDP, "set_epoch with the epoch plus the rank", 6,
     [("train_sampler.set_epoch(epoch)", "train_sampler.set_epoch(epoch + rank)")]),
    ("ddp", DDP, "loss_history gets the loss as a number", 7,
     [("            loss_history.append(step_loss)\n",
       "            loss_history.append(step_loss.item())\n")]),
    ("ddp", DDP, "the shipped device line left below setup()", 2,
     [("    local_rank, rank, device, world_size = setup(args.seed, args.device)\n",
       "    local_rank, rank, device, world_size = setup(args.seed, args.device)\n"
       "    device = torch.device(\"cuda\" if torch.cuda.is_available() and args.device != "
       "\"cpu\" else \"cpu\")\n")]),
    ("ddp", DDP, "rank set again from SLURM_PROCID after setup()", 2,
     [("import math\n", "import math\nimport os\n"),
      ("    local_rank, rank, device, world_size = setup(args.seed, args.device)\n",
       "    local_rank, rank, device, world_size = setup(args.seed, args.device)\n"
       "    rank = int(os.environ.get(\"SLURM_PROCID\", 0))\n")]),
    ("ddp", DDP, "the model wrapped in DDP before model.num_params()", 5,
     [("\n    model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)\n", "\n"),
      ("    model = TransformerLM(cfg).to(device)\n",
       "    model = TransformerLM(cfg).to(device)\n    model = DDP(model, device_ids=[local_rank] if device.type == \"cuda\" else None)\n")]),
    ("ddp", DDP, "the evaluation's sums reduced inside its batch loop", 8,
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n", ""),
      ("        tokens += (y != IGNORE_INDEX).sum()  # padding samples have no targets\n",
       "        tokens += (y != IGNORE_INDEX).sum()  # padding samples have no targets\n"
       "        loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n")]),
    ("ddp", DDP, "the validation loss averaged where evaluate() is called", 8,
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n", ""),
      ("        val_loss = evaluate(model, val_loader, device)\n",
       "        val_loss = all_reduce_mean(torch.tensor(evaluate(model, val_loader, device)))"
       ".item()\n")]),
    ("ddp", DDP, "the logged loss the maximum over the ranks", 7,
     [("import torch.nn.functional as F\n",
       "import torch.nn.functional as F\nimport torch.distributed as dist\n"),
      ("step_loss = all_reduce_mean(loss.detach())",
       "step_loss = loss.detach().clone()\n"
       "            dist.all_reduce(step_loss, op=dist.ReduceOp.MAX)")]),
    ("ddp", DDP, "destroy_process_group() before monitor.close()", 11,
     [("    monitor.close(summary)\n", ""),
      ("    destroy_process_group()\n",
       "    destroy_process_group()\n    monitor.close(summary)\n")]),
    ("ddp", DDP, "a barrier after destroy_process_group()", 11,
     [("import torch.nn.functional as F\n",
       "import torch.nn.functional as F\nimport torch.distributed as dist\n"),
      ("    destroy_process_group()\n", "    destroy_process_group()\n    dist.barrier()\n")]),
    # ---- a seed per rank before the model: FSDP, TP and the stages keep each rank's own ----
    ("pp", PP, "the stages cut from models of a seed per rank", 36,
     [("    model = TransformerLM(cfg).to(device)\n",
       "    torch.manual_seed(args.seed + rank)\n    model = TransformerLM(cfg).to(device)\n")]),
    ("fsdp", FSDP, "the model built from a seed per rank, then sharded", 18,
     [("    model = TransformerLM(cfg).to(device)\n",
       "    torch.manual_seed(args.seed + rank)\n    model = TransformerLM(cfg).to(device)\n")]),
    ("ddp", DDP, "the logged loss summed over the ranks and divided by 2", 7,
     [("step_loss = all_reduce_mean(loss.detach())",
       "step_loss = all_reduce_sum(loss.detach()) / 2")]),
    ("fsdp", FSDP, "--reshard-after-forward defaulting to false", 18,
     [('choices=["true", "false"], default="true",', 'choices=["true", "false"], default="false",')]),
    ("fsdp", FSDP, "FSDPModule imported as FSDP1's FullyShardedDataParallel", 17,
     [('from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard\n',
       'from torch.distributed.fsdp import FullyShardedDataParallel as FSDPModule\nfrom torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n')]),
    ("fsdp", FSDP, 'the root given reshard_after_forward too', 18,
     [('    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n',
       '    fully_shard(model, reshard_after_forward=reshard_after_forward,\n                mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n')]),
    ("fsdp", FSDP, 'the checkpoints saved to a relative path, outside --out-dir', 20,
     [('save_sharded_model(model, optimizer, out_dir / "checkpoints" / name, train_state)',
       'save_sharded_model(model, optimizer, Path("checkpoints") / name, train_state)')]),
    ("fsdp", FSDP, "'best' saved at every epoch, improved or not", 20,
     [('            save_checkpoint("best", epoch, batches_done)\n',
       ''),
      ('        # DONE 20: Save the last checkpoint at the end of every epoch',
       '        save_checkpoint("best", epoch, batches_done)\n        # DONE 20: Save the last checkpoint at the end of every epoch')]),
    ("fsdp", FSDP, "'best' saved on rank 0 only", 20,
     [('            save_checkpoint("best", epoch, batches_done)\n',
       '            if rank == 0:\n                save_checkpoint("best", epoch, batches_done)\n')]),
    ("fsdp", FSDP, "'last' not saved where --max-steps stops the run", 20,
     [('        save_checkpoint("last", epoch, batches_done)\n        if step == args.max_steps:\n            break\n',
       '        if step == args.max_steps:\n            break\n        save_checkpoint("last", epoch, batches_done)\n')]),
    ("fsdp", FSDP, 'the resume code above the lines that start step, best_val and loss_history', 21,
     [('    resume = resume_checkpoint(args.resume, out_dir / "checkpoints")\n    if resume:\n        train_state = load_sharded_model(model, optimizer, resume, cfg.to_dict())\n        step, start_epoch, start_batch = resume_position(train_state, global_batch,\n                                                         len(train_loader), args.max_steps)\n        best_val = train_state["best_val"]\n        loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]\n        print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")\n',
       ''),
      ('    # ---- training ----\n    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan\n    start_epoch, start_batch = 0, 0\n',
       '    resume = resume_checkpoint(args.resume, out_dir / "checkpoints")\n    if resume:\n        train_state = load_sharded_model(model, optimizer, resume, cfg.to_dict())\n        step, start_epoch, start_batch = resume_position(train_state, global_batch,\n                                                         len(train_loader), args.max_steps)\n        best_val = train_state["best_val"]\n        loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]\n        print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")\n    # ---- training ----\n    loss_history, step, best_val, val_loss = [], 0, math.inf, math.nan\n    start_epoch, start_batch = 0, 0\n')]),
    ("fsdp", FSDP, 'the next epoch set on the sampler at the end of an epoch', 21,
     [('        train_sampler.set_epoch(epoch)\n',
       ''),
      ('        throughput.pause()',
       "        train_sampler.set_epoch(epoch + 1)  # the next epoch's order\n        throughput.pause()")]),
    ("fsdp", FSDP, 'the batches skipped on resuming not counted in batches_done', 21,
     [('        batches_done = start_batch if epoch == start_epoch else 0\n',
       '        batches_done = 0\n'),
      ('        for x, y in monitor.batches(itertools.islice(train_loader, batches_done, None)):\n',
       '        skip = start_batch if epoch == start_epoch else 0\n        for x, y in monitor.batches(itertools.islice(train_loader, skip, None)):\n')]),
    ("fsdp", FSDP, "the reshard flag compared with 'false'", 19,
     [('args.reshard_after_forward == "true")', 'args.reshard_after_forward == "false")')]),
    ("fsdp", FSDP, 'the full model exported to a relative path', 22,
     [('    save_full_model(model, out_dir / "final_model.pt")\n',
       '    save_full_model(model, "final_model.pt")\n')]),
    ("fsdp", FSDP, "output_dtype=torch.float32 in the blocks' policy too (a CPU cannot run it in bf16)", 18,
     [('                    mp_policy=MixedPrecisionPolicy(**policy))\n',
       '                    mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n')]),
    ("tp", TP, "the model built from a seed per rank, then split", 28,
     [("    model = TransformerLM(cfg).to(device)\n",
       "    torch.manual_seed(args.seed + rank)\n    model = TransformerLM(cfg).to(device)\n")]),
    ("memory", MEM, "the model built from a seed per rank, sharded in the FSDP layouts", 56,
     [("    model = TransformerLM(cfg).to(device)\n",
       "    torch.manual_seed(args.seed + rank)\n    model = TransformerLM(cfg).to(device)\n")]),
    # ---- tensor parallelism: the second red-team round's mistakes ----------------------------
    ("tp", TP, "--tp parsed by type=int (0 taken)", 25,
     [('parser.add_argument("--tp", type=positive_int,', 'parser.add_argument("--tp", type=int,')]),
    ("tp", TP, "apply_tp without its return model", 24,
     [("    # computes the same result, and the gradients DTensor hands back to them are already whole.\n"
       "    return model\n",
       "    # computes the same result, and the gradients DTensor hands back to them are already whole.\n")]),
    ("tp", TP, "--tp defaults to the GPUs of the node", 25,
     [('default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),',
       "default=torch.cuda.device_count() or 1,")]),
    ("tp", TP, "--tp defaults to SLURM_NTASKS_PER_NODE", 25,
     [('default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),',
       'default=int(os.environ.get("SLURM_NTASKS_PER_NODE", 1)),')]),
    ("tp", TP, "the training loss divided by the tp degree", 30,
     [("                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n",
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.tp\n")]),
    ("tp", TP, "evaluation samplers given dp_rank and dp_size by position, swapped", 27,
     [("DistributedEvalSampler(val_ds, num_replicas=dp_size, rank=dp_rank)",
       "DistributedEvalSampler(val_ds, dp_rank, dp_size)"),
      ("DistributedEvalSampler(test_ds, num_replicas=dp_size, rank=dp_rank)",
       "DistributedEvalSampler(test_ds, dp_rank, dp_size)")]),
    ("tp", TP, "local_params counted before apply_tp", 28,
     [('    model = apply_tp(model, mesh["tp"])\n'
       "    local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()\n"
       "                       for p in model.parameters())\n",
       "    local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()\n"
       "                       for p in model.parameters())\n"
       '    model = apply_tp(model, mesh["tp"])\n')]),
    ("tp", TP, "the summary's params_per_rank from model.num_params()", 31,
     [("params_per_rank=local_params, memory=monitor.memory)",
       "params_per_rank=model.num_params(), memory=monitor.memory)")]),
    ("tp", TP, "loss_history gets each replica's own loss (the step lines the mean)", 31,
     [("            loss_history.append(step_loss)\n",
       "            loss_history.append(loss.detach())\n")]),
    # ---- the test split's sampler, read as carefully as the validation split's -------------
    ("pp", PP, "the test sampler split over the ranks", 35,
     [("test_sampler = DistributedEvalSampler(test_ds, num_replicas=1, rank=0)",
       "test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)")]),
    ("tp", TP, "the test sampler counts processes", 27,
     [("test_sampler = DistributedEvalSampler(test_ds, num_replicas=dp_size, rank=dp_rank)",
       "test_sampler = DistributedEvalSampler(test_ds, num_replicas=world_size, rank=rank)")]),
]

# Words the FIX line of a mistake must hold (what to change, named): what -> words.
MESSAGES = {
    "the GPU's operator table sorted by device_time_total": ("sort_by='self_device_time_total'",),
    "the CPU's operator table sorted by cpu_time_total": ("sort_by='self_cpu_time_total'",),
    "MFU's FLOPs per token as 6 N, without the attention's 12 L d T": ('6 N alone', '12 L d T'),
    "the interval's tokens never set back, its clock is": ('the rate grows from report to report',),
    "the rate read from the course monitor's throughput.tokens_per_s()": ('nan tokens/s',),
    "the interval's tokens counted as log_every steps": (
        "the epoch's first report", "not --log-every times"),
    'the profiler stepped again in the report block': (
        'profiler.step() once after every training step',),
    "the profiler stopped at every epoch's end": ('stepped after profiler.stop()',),
    'the validation loss computed under autocast': ('the evaluation runs under autocast',),
    'the whole model compiled in place (model.compile())': ('compiles the whole model in one',),
    'each block compiled into a loop variable': ('the model keeps its plain blocks',),
    "the loss compiled with mode='reduce-overhead' at TODO 61": ("--compile alone compiles lm_loss in mode 'reduce-overhead'",),
    '--compile-mode defaulting to reduce-overhead': ("--compile-mode defaults to 'reduce-overhead'",),
    "the logged loss summed over the ranks and divided by 2": (
        "on 4 ranks (the stand-in GPU run)", "Divide by the world size"),
    "FSDPModule imported as FSDP1's FullyShardedDataParallel": (
        "FSDPModule is FullyShardedDataParallel here", "from torch.distributed.fsdp import "
        "FSDPModule"),
    "the root given reshard_after_forward too": (
        "the root gets reshard_after_forward=True", "leave it out of fully_shard(model, ...)"),
    "the checkpoints saved to a relative path, outside --out-dir": (
        "into the current folder", "out_dir / 'checkpoints' / name"),
    "'best' saved at every epoch, improved or not": (
        "still saved a new 'best'", "if val_loss < best_val"),
    "'best' saved on rank 0 only": ("rank 0 saves best", "not under `if rank == 0:`"),
    "'last' not saved where --max-steps stops the run": (
        "saved 'last' for the last time after step 6", "before the break at args.max_steps"),
    "the resume code above the lines that start step, best_val and loss_history": (
        "trained all 10 steps again", "resume after those lines"),
    "the next epoch set on the sampler at the end of an epoch": (
        "goes on in epoch 1", "set_epoch(epoch) at the start of every epoch"),
    "the batches skipped on resuming not counted in batches_done": (
        "after resuming, the checkpoint after step 10 says epoch 1, batches_done 3",
        "batches_done = start_batch"),
    "the reshard flag compared with 'false'": ("the flag arrives inverted",),
    "the full model exported to a relative path": (
        "final_model.pt is written into the current folder",
        "save_full_model(model, out_dir / 'final_model.pt')"),
    "output_dtype=torch.float32 in the blocks' policy too (a CPU cannot run it in bf16)": (
        "with --precision bf16", "give output_dtype to the root only"),
    "the script and its arguments inside bash -c's single quotes": (
        "inside bash -c's single quotes", "after the closing quote"),
    "apply_fsdp checkpoints the blocks itself, whatever the flag says": (
        "no --activation-checkpointing, the blocks are checkpoint_wrapper's",
        "only under `if args.activation_checkpointing:`"),
    "the final model saved by dcp.save straight into its folder": (
        "writes straight into final_model", "atomic_folder(out_dir / 'final_model')"),
    "the training's autocast written out as bf16": (
        "under autocast in bfloat16 in a run with --precision fp32", "autocast(args.precision"),
    "tokens counted per micro-batch (grad_accum left out)": ("0.5 x", "args.grad_accum"),
    "tokens counted on every micro-batch, each as a whole step": (
        "once per micro-batch", "once per optimizer step"),
    "the trace's events indexed e[\"cat\"] (metadata events have none)": (
        "KeyError: 'cat'", "e.get('cat')"),
    "the bubble timer on the evaluation stage": ("the timer wraps eval_stage", "StageBusyTimer(stage, device)"),
    "timer.start_step() after schedule.step": ("recorded no computation", "right before schedule.step"),
    "tokens counted on the last stage only (rank 0 reports none)": ("only rank 1 counts tokens", "on every rank"),
    "the validation line printed on every rank": ("rank 1 prints too", "print0"),
    "the training sampler without the run's seed": ("seed=args.seed",),
    "the training sampler left to its defaults for shuffle and seed": ("seed=args.seed",),
    "DistributedEvalSampler for the training split": ("DistributedSampler(train_ds",),
    "the model wrapped in DDP twice": ("twice", "wrap the model once"),
    "the loss averaged over the ranks before backward": ("the rank's own loss",),
    "the optimizer made before apply_tp and fully_shard": ("after fully_shard",),
    "the sharded state dict torch.save-d on rank 0 as the final model": (
        "DTensors", "save_full_model(model, path)"),
    "apply_fsdp called without the precision (its default: fp32)": ("args.precision",),
    "the checkpoints saved without the optimizer": ("no optimizer state",),
    "samplers count processes": ("num_replicas=dp_size, rank=dp_rank",),
    "the received chunk added into the chunk sent": ("chunks[into] += received",),
    "the reduce-scatter's steps counted from 1 (one step off)": (
        "one step off: s counts from 0 to n - 2",),
    "every step range and every event named all_reduce counted": (
        "counted 4 steps (2 in the trace: ProfilerStep#N of category user_annotation only",
        "9 all-reduce events (3: the AllReduce kernels only"),
    "the rate in tokens per millisecond": ("counts seconds",),
    "sequences counted, not tokens": ("x.numel()", "len(x)"),
    "the interval's clock restarted inside every step": ("not inside the step",),
    "the interval's clock started at the top of every step": ("not inside the step",),
    "the peak printed in GFLOP/s under TFLOP/s": ("1000 x what peak_flops returns",),
    "NVTX ranges pushed and never popped": ("range_pop()", "torch.cuda.nvtx.range(name)"),
    "FLOPs per token as 6 x all parameters (the embedding tables counted)": (
        "lookups, not matmuls", "exclude_embeddings=True"),
    "MFU of the step line from all parameters' FLOPs of its own": (
        "embedding tables", "exclude_embeddings=True"),
    "MFU divided by the peak in TFLOP/s": ("1e12 x the formula's", "peak in FLOP/s"),
    "tokens/s over the steps' own time (data loading and logging left out)": (
        "not inside the step",),
    "a short run's window one step too long": (
        "profiler_window(2) returns (0, 1, 2)", "(--max-steps 2) ends before it"),
    "a run too short to profile says nothing": ("too short to profile",),
    "NVTX ranges on every device (a CPU has none)": ("device.type == 'cuda'",),
    "NVTX ranges started and never ended": ("range_end", "torch.cuda.nvtx.range(name)"),
    "gpu_busy in microseconds": ("divide by 1e3",),
    "gpu_busy's two numbers swapped": ("swapped",),
    "gpu_busy divides by PROFILE_ACTIVE, not the steps counted": ("its count",),
    "traces written into OUT_DIR itself": ("out_dir / 'profile'",),
    "--compile-mode compiles without --compile": ("only with --compile",),
    "the evaluation's inputs padded with IGNORE_INDEX": ("index out of range", "pad inputs with 0"),
    "the checkpoint loaded on rank 0 only": ("on every rank",),
    "resume_position given this rank's batch": ("args.batch_size * world_size",),
    "a restart without --resume starts at step 0": ("whether or not --resume is given",),
    "every rank says where it resumed": ("print0",),
    "--reshard-after-forward as type=bool": ("type=bool", "choices=['true', 'false']"),
    "--reshard-after-forward as store_true": ("choices=['true', 'false']",),
    "tokens of one replica (not times dp_size)": ("x.numel() * dp_size",),
    "params_per_rank left out of the summary": ("TODO 31 (per replica): params_per_rank is "
                                                "missing", "params_per_rank=local_params"),
    "the training sampler of one replica (both replicas read the same batches)": (
        "num_replicas=dp_size, rank=dp_rank",),
    "the output layer's logits replicated": ("whole on every rank", "without output_layouts"),
    "the peak printed with one decimal in TFLOP/s (0.0 for the check's peak)": (
        "the printed peak (0.0 TFLOP/s) does not show 2.5e+10 FLOP/s", "3 significant digits"),
    "every row's self device time summed (each kernel twice, the GPU's ranges too)": (
        "counted twice", "the row of the CPU operator that launched it",
        "e.device_type != DeviceType.CPU and not e.is_user_annotation"),
    "the CPU operators' rows and the kernels' rows summed (each kernel twice)": (
        "counted twice", "e.device_type != DeviceType.CPU"),
    "the GPU's ranges summed with the kernels": ("is_user_annotation",),
    "the steps counted in the GPU's ProfilerStep* row too": (
        "counted twice", "e.device_type == DeviceType.CPU"),
    "GPU time summed with the operators inside each other": ("device_time_total counts",),
    "the loss under loss_parallel kept a DTensor": ("loss = loss.full_tensor()",),
    "evaluate's loss sum kept a DTensor": (".full_tensor()",),
    "apply_tp after fully_shard": ("TP first",),
    "dp_rank from the tp dim": ("mesh['dp'].get_local_rank()",),
    "evaluation's loss taken whole without loss_parallel": ("loss_parallel()",),
    "samplers count processes, and evaluate's loss sum kept a DTensor": (
        "num_replicas=dp_size, rank=dp_rank",),
    "evaluation samplers without num_replicas and rank, and evaluate's loss sum kept a "
    "DTensor": ("validation sampler has num_replicas=1", "num_replicas=dp_size, rank=dp_rank"),
    "the logits gathered in training, and evaluation without loss_parallel": (
        "never runs under loss_parallel()",),
    "tokens of one replica, and evaluate's loss sum kept a DTensor": ("x.numel() * dp_size",),
    "the training loss summed over the replicas, and evaluate's loss sum kept a DTensor": (
        "twice the mean",),
    "the training loss summed over the replicas": ("twice the mean",),
    "apply_tp leaves tp 1 whole, and the loss's full_tensor() stops the run on two nodes": (
        "on two nodes (tp 1, dp 2)", "for tp 1 as well"),
    "apply_tp leaves tp 1 whole, and evaluate's full_tensor() stops the run on two nodes": (
        "on two nodes (tp 1, dp 2)", "in evaluate", "for tp 1 as well"),
    "apply_tp leaves tp 1 whole, evaluate stops on two nodes, and the training loss not "
    "averaged": ("all_reduce_mean(loss.detach(), group=dp_group)",),
    "apply_tp leaves tp 1 whole (two nodes stop in training), and evaluate's loss sum kept a "
    "DTensor": ("on two nodes (tp 1, dp 2)", "for tp 1 as well"),
    "the training loss not averaged (each replica logs its own)": (
        "all_reduce_mean(loss.detach(), group=dp_group)",),
    "evaluate returns the mean of the replicas' means": ("all_reduce_sum(t, dp_group)",),
    "local_params from the DTensors' global sizes, and evaluate's loss sum kept a DTensor": (
        "p.to_local().numel()",),
    "FSDP on the root only, and evaluate's loss sum kept a DTensor": ("fully_shard every block",),
    "dp_group from the tp dim, and evaluate's loss sum kept a DTensor": (
        "mesh['dp'].get_group()",),
    "the loss averaged over all processes, and evaluate's loss sum kept a DTensor": (
        "group=dp_group",),
    "evaluation samplers of one replica, and evaluate's loss sum kept a DTensor": (
        "on two nodes (tp 1, dp 2)", "num_replicas=dp_size, rank=dp_rank"),
    "the embedding not split, and evaluate's loss sum kept a DTensor": (".full_tensor()",),
    "evaluate given the dp sub-mesh instead of its group": ("mesh['dp'].get_group()",),
    "evaluate's loss on the local logits (to_local())": ("inside loss_parallel()",),
    "tokens of one replica, and evaluate's loss on the local logits": (
        "on two nodes (tp 1, dp 2) throughput.step", "x.numel() * dp_size"),
    "check_tp_degree after the mesh is built": ("check_tp_degree(args.tp, world_size, cfg)",),
    "bash -c's $0 left out (the script taken as $0)": ("as $0", "torchrun \"$SCRIPT\""),
    "FSDP over the whole 2-D mesh": ("mesh=mesh['dp']",),
    "a CUDA mesh written in": ("init_device_mesh(device.type",),
    "a profiler schedule without repeat=1 (a trace every cycle)": ("repeat=1",),
    "traces not named after their rank": ("worker_name=f'rank{rank}'",),
    "the profiler's window from every epoch's steps, --max-steps left out": (
        "min(steps_available, args.max_steps)",),
    "the rate of one step's tokens over the whole interval": ("0.5 x", "interval_tokens +="),
    "MFU multiplied by 100 and printed with %": ("100 x the formula's",),
    "a vocabulary that is a multiple padded by one more": ("stays as it is",),
    "the step's time from its self CPU time": ("self_cpu_time_total leaves out",),
    "gpu_busy whenever --profile is given (a short run has no profiler)": (
        "if profiler is not None",),
    "resume_checkpoint looks in OUT_DIR, the checkpoints are in OUT_DIR/checkpoints": (
        "in OUT_DIR,", "out_dir / 'checkpoints'"),
    "the string 'false' turned into a bool for apply_fsdp": ("bool('false') is True",),
    "set_epoch on rank 0 only (the shards overlap from the second epoch)": (
        "rank 1 reads the first epoch's order again", "none under `if rank == 0:`"),
    "the evaluation samplers given rank and world_size by position": (
        "num_replicas=0", "num_replicas=world_size, rank=rank"),
    "the averaged loss made a number with .item()": ("drop .item()",),
    "the process group destroyed right after the test evaluation": (
        "every rank counts as rank 0", "after del model, optimizer"),
    "set_epoch(epoch + 1)": ("set_epoch gets 1", "train_sampler.set_epoch(epoch)"),
    "the loss averaged for the step line only": ("loss_history",
                                                 "step_loss = all_reduce_mean(loss.detach())"),
    "all_reduce_mean given world_size": ("process group", "leave it out"),
    "#SBATCH --gres after the first command": ("move it up",),
    "--nnodes=2 written out (one node waits for a second)": (
        'on one node', '--nnodes="$SLURM_JOB_NUM_NODES"'),
    "--ntasks=1 for the whole job": ("#SBATCH --ntasks-per-node=1",),
    "every Address line of nslookup (the DNS server's too)": ("MASTER_ADDR holds 2 lines",
                                                               "DNS server"),
    "nslookup without || true (a node without an InfiniBand name)": ("|| true",),
    "a MASTER_PORT set before the job replaced": ("${MASTER_PORT:-",),
    "the sampler's rank from the processes, its count from the replicas": (
        "Invalid rank 1", "rank=dp_rank"),
    "every stage keeps the final norm": ("stage 0 keeps norm",),
    "the bf16 policy given to the root only (the blocks gather fp32)": (
        "the blocks gather fp32 weights", "reduce_dtype=torch.float32"),
    "the root's logits left in bf16 (no output_dtype)": ("output_dtype=torch.float32",),
    "gradients summed in bf16 (no reduce_dtype)": ("summed in bf16",),
    "each block's attention and MLP sharded instead of the block": (
        "parts of the blocks (layers.0.attn, layers.0.mlp", "fully_shard(block, ...)"),
    "fp16 for bf16 in the policy (float16 gathered and summed)": (
        "every unit gathers fp16 weights", "loss scaling", "param_dtype=torch.bfloat16"),
    "model.layers iterated (its names, not its blocks)": ("model.layers.values()",),
    "the loss history saved as tensors": ("JSON", "loss.item()"),
    "the microbatches' losses summed": ("the sum of the microbatches' losses",),
    "saved before step += 1": ("says step 2",),
    "backward after loss_parallel() ended": ("backward pass ran outside loss_parallel()",),
    "saved inside the step, before its batch is counted": ("says epoch 0, batches_done 2",),
    "the last checkpoint of an epoch saved as the next epoch's start": ("says epoch 2",),
    "the peak of bf16 written in (an fp32 run's MFU 15 times too small on a GPU)": (
        "asks peak_flops for bf16", "peak_flops(device, args.precision)"),
    "the peak asked before set_precision (auto: fp32's peak on a GPU in bf16)": (
        "asks peak_flops for auto", "set_precision"),
    "the DDP model kept alive past destroy_process_group": ("del model, optimizer before",),
    "the mode of the lesson written in": ("compiled in mode reduce-overhead",
                                          "mode=args.compile_mode"),
    "--compile-mode passed on for reduce-overhead alone": ("compiled in the default mode",
                                                           "compile_blocks(model, args.compile_mode)"),
    "ZeroRedundancyOptimizer without AdamW's arguments": ("weight_decay=", "lr=args.lr"),
    "only the root sharded": ("only the root", "fully_shard(block"),
    "the ModuleDict of blocks sharded as one": ("ModuleDict(...)", "each block of model.layers"),
    "DDP's no_sync() called on every layout (FSDP2 has none)": ("no_gradient_sync(model)",),
    "the forward outside no_sync, as the wording 'backward inside' reads": ("forward pass too",),
    "offload's host memory never pinned on a GPU": ("on a GPU", "pin_memory="),
    "the send's request never waited for": ("never waits for the request", "wait()"),
    "the receive buffer sized like the chunk sent": ("bytes arrived in a buffer",),
    "a line through the first and the last point": ("least squares",),
    "offload pins host memory on a machine without a GPU too": (
        "pin_memory=torch.cuda.is_available()",),
    "only the blocks offloaded, the root kept on the device": (
        "2 of the 3 FSDP units have offload_policy=CPUOffloadPolicy(); missing: the root",),
    "only the root offloaded, the blocks kept on the device": (
        "1 of the 3 FSDP units has offload_policy=CPUOffloadPolicy(); missing: the blocks",),
    "offload without CPUOffloadPolicy": ("no FSDP unit has offload_policy=CPUOffloadPolicy()",),
    "the loss divided by the micro-batches and by the ranks": ("in every run", "0.5 x",
                                                                "args.grad_accum only"),
    "the reentrant checkpointing": ("non-reentrant",),
    "no_sync on rank 0 only": ("same micro-batches on every rank",),
    "optimizer.step() every micro-batch": ("optimizer.step() ran", "once per micro-batch"),
    "zero_grad every micro-batch": ("zero_grad() ran between the micro-batches",),
    "the receive buffer float32 for float64 chunks": ("dtype", "torch.empty_like(chunks[into])"),
    "rank 0 makes one all-gather step fewer": ("rank 0 made 1", "range(n - 1)"),
    "only the last request of batch_isend_irecv waited for": ("never waits for the request",
                                                              "wait() for each"),
    "the neighbours without % n (rank n - 1 sends to rank n)": ("rank 2 sends to rank 3",
                                                                "% n"),
    "the reduce-scatter makes n steps, not n - 1": ("makes 3 send/receive steps",
                                                    "n - 1 = 2"),
    "the reduce-scatter averages (divides its chunk by n)": ("divided by n", "do not divide"),
    "the all-gather assigns a new buffer to the list": ("only in the list",
                                                        "straight into chunks[into]"),
    "the fit returns (busbw, latency)": ("swapped", "return (latency, busbw)"),
    "the fit asks dist.get_world_size() (not its argument)": ("world_size argument",),
    "the bus factor by integer division (2 * (n - 1) // n is 1)": ("//", "with /"),
    "the latency returned in milliseconds": ("milliseconds: return seconds",),
    "the bus bandwidth in bits per second": ("not bits",),
    "device_ids by the global rank (GPU 2 on a node of 2)": ("2 stand-in GPUs",
                                                             "device_ids=[local_rank]"),
    "the clock read before synchronize": ("synchronize(device)",),
    "the profiler records the CPU only, also on a GPU": ("ProfilerActivity.CUDA",),
    "set_precision's answer not kept (auto stays auto)": ("args.precision = set_precision",),
    "fused when the device equals the string 'cuda'": ("on a GPU", "fused=False"),
    "the loss averaged over all processes, TP copies included": ("group=dp_group",),
    "the sums over ranks thrown away (taken for in place)": ("new tensor", "throw them away",
                                                            "= all_reduce_sum(loss_sum)"),
    "world_size = 1 left after setup": ("still 1 after setup()",
                                        "delete the line `world_size = 1`"),
    "world_size from LOCAL_WORLD_SIZE (1 on each of two nodes)": ("take world_size from setup()",),
    "the port the job id modulo 65536 (below 1024 for some ids)": (
        "port 0 for job", "only root may listen below 1024"),
    "the port 20000 + the job id modulo 50000 (above 65535 for some ids)": (
        "port 67024 for job", "the last port is 65535"),
    "the endpoint's port written out (MASTER_PORT unused)": (
        "the endpoint uses port 29500", '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"'),
    "a static rendezvous (--node_rank, --master_addr) for c10d": ("static rendezvous",),
    "CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS before the site profile is sourced": (
        "SITE_GPU_IDS comes from the site profile", "after `source sites/job.sh`"),
    "$SITE_GPU_IDS used before the site profile is sourced": (
        "SITE_GPU_IDS comes from the site profile", "after `source sites/job.sh`"),
    "validation on rank 0 only": ("every rank must call evaluate()",),
    "the evaluation schedule on the training's stage": ("its own",
                                                        "eval_stage = PipelineStage("),
    "training mode not restored after evaluation": ("model.train()",),
    "the logged loss averaged on rank 0 only, in its print": ("every rank must call it",),
    "training sampler without drop_last": ("drop_last=True",),
    "test sampler over the validation set": ("DistributedEvalSampler(test_ds",),
    "test DataLoader with the validation sampler": ("sampler=test_sampler",),
    "test DataLoader without its sampler": ("sampler=test_sampler",),
    "drop_last=True in loader_args (evaluation drops samples)": ("training DataLoader alone",),
    "set_epoch(step) in the batch loop": ("once per epoch",),
    "every rank's sampler seeded with its rank (the shards overlap)": (
        "seeds 0, 1", "the same seed on every rank, seed=args.seed"),
    "set_epoch at the end of the epoch (the first two epochs alike)": (
        "repeats the first epoch's order", "at the start of each epoch"),
    "the port is 20000 + the whole job id": ("outside 1024-65535", "% 10000"),
    "srun without --cpus-per-task": ('--cpus-per-task="$SLURM_CPUS_PER_TASK"',),
    "--nproc_per_node=4 written out": ("NPROC_PER_NODE=2", '--nproc_per_node="$NPROC_PER_NODE"'),
    "the split made with the local rank (the stage with the global)": (
        "as for the PipelineStage",),
    "microbatch size given as the number of microbatches": ("the number of microbatches",),
    "the loss_fn given to the last stage's schedule only": ("no loss_fn", "on every rank"),
    "samplers with num_replicas=1 but rank=rank": ("Invalid rank 1",),
    "DCP state_dict nested under 'model'": ("'model.'", "dcp.save(model.state_dict()"),
    "torch.cuda.synchronize() with no device test": ("synchronize(device) from utils.metrics",),
    "tokens/s per rank, MFU per device (right)": ("interval_tokens += x.numel() * world_size",),
    "MFU's FLOPs per token from all parameters (the embedding tables counted)": (
        "lookups, not matmuls", "exclude_embeddings=True", "output projection is a matmul"),
    "FLOPs per token written out from all parameters": (
        "embedding tables", "lookups, not matmuls", "exclude_embeddings=True"),
    "the output projection left out of the FLOPs too (as if tied to the embedding)": (
        "fewer than", "output projection is a matmul and stays counted"),
    "the whole profiling window for every run of 2 steps or more": (
        "profiler_window(2) returns (1, 2, 3)", "(--max-steps 2) ends before it", "or return None"),
    "only the active steps shrunk for a short run": (
        "profiler_window(2) returns (1, 2, 1)", "Shrink it to the steps available"),
    "the active steps without min() (a long run records every step)": (
        "grows with the run", "min(PROFILE_ACTIVE"),
    "the interval clock started once, before the epochs (evaluation counted)": (
        "the first after an evaluation", "start the interval with each epoch"),
    "tokens/s cumulative since the epoch began (no reset after a report)": (
        "after each report",),
    "fp16 autocast (no GradScaler) for the bf16 run": ("float16", "GradScaler"),
    "PROFILER as one string": ("bash array", '"${PROFILER[@]}"'),
    "nsys put before srun (profiles srun, not the training)": ("inside the srun line",),
    "evaluation without the training autocast": ("outside any autocast",
                                                 "autocast(precision, device)"),
    "the root sharded before the blocks": ("fully_shard(model, ...) last",),
    "the global batch saved as one rank's batch": ("args.batch_size * world_size",),
    "resume_position given the samples per epoch": ("len(train_loader)",),
    "--resume taken as the folder, without resume_checkpoint": ("resume_checkpoint(args.resume",),
    "loss_history restored as floats": ("torch.tensor(loss, device=device)",),
    "the model's configuration saved as config": (
        "no key model_config (= cfg.to_dict())", "load_sharded_model compares it"),
    "the step saved as steps": ("no key step", "resume_position reads it"),
    "best_val neither saved nor restored": ("no key best_val",),
    "the best validation loss saved as best_val_loss, read back as best_val": (
        "no key best_val", "best_val_loss"),
    "best_val saved, read back as best_val_loss": ("no key 'best_val_loss'",),
    "no line says where the run resumed": (
        "say on rank 0 where the run resumed from and at which step",),
    "rank 0 says where it resumed, not at which step": (
        "say on rank 0 where the run resumed from and at which step",),
    "every rank says where it resumed, in other words": ("print0",),
    "the embedding's input not replicated": ("input_layouts=Replicate()",),
    "--tp defaults to LOCAL_WORLD_SIZE without a fallback": ("os.environ.get('LOCAL_WORLD_SIZE', 1)",),
    "the mesh's names the other way round": ("mesh_dim_names=('dp', 'tp')",),
    "dp_group from the tp dim": ("mesh['dp'].get_group()",),
    "local_params from the DTensors' global sizes": ("to_local().numel()",),
    "the blocks sharded without the dp mesh": ("mesh=mesh['dp']",),
    "the loss broadcast on the last stage only": ("different collectives",),
    "the training schedule built with the summing loss": ("lm_loss_sum", "lm_loss), the mean"),
    "the kept blocks renumbered from 0 in a new ModuleDict": ("del model.layers[name]",
                                                              "keep their keys"),
    "no zero_grad before schedule.step": ("optimizer.zero_grad(",),
    "optimizer.step() on the last stage only": ("stage 0 never called optimizer.step()",),
    "schedule.eval without losses=": ("losses=losses to schedule.eval",),
    "schedule.eval without target=": ("target=y",),
    "evaluation tokens counted on the last stage only": ("outside `if losses:`",),
    "the evaluation stage built on a copy of the model": ("PipelineStage(model,", "not a copy"),
    "--layers-per-stage not passed on": ("args.layers_per_stage",),
    "the loss broadcast's result assigned": ("returns None", "without assigning"),
    "the loss broadcast from each rank's own stage": ("the same on every rank",
                                                      "src=num_stages - 1"),
    "the evaluation's padded targets 0": ("IGNORE_INDEX", "pad_batch(x, y, loader.batch_size)"),
    "the evaluation's padding counted in the tokens": ("(y != IGNORE_INDEX).sum()",),
    "blocks deleted while the loop walks model.layers": (
        "line", "RuntimeError: dictionary changed size during iteration", "list(model.layers)"),
    "evaluate still runs the model itself (TODO 40 as shipped)": (
        "not started", "mixed dtype", "a stage without the embeddings", "schedule.eval("),
    "zero_grad left between schedule.step and optimizer.step": (
        "zeroed after schedule.step", "optimizer.zero_grad(set_to_none=True) before "
        "schedule.step"),
    "schedule.step outside the autocast": (
        "keep schedule.step inside the with autocast(args.precision, device): block",),
    "all_reduce_mean's import gone before TODO 38 replaces it": (
        "all_reduce_mean is no longer imported", "until TODO 38"),
    "DDP's import gone before TODO 29 replaces DDP": (
        "DDP is no longer imported (TODO 23's import lines)", "until TODO 29"),
    "dp_rank from mesh['dp'].get_rank() (the global rank)": ("mesh['dp'].get_local_rank()",),
    "evaluation with the training schedule": ("eval_schedule",),
    "the evaluation's microbatch sums averaged": ("torch.stack(losses).sum()",),
    "the logged loss undivided, backward on the divided loss": ("gradients are right",
                                                                 "log the divided loss"),
    "ZeroRedundancyOptimizer for the FSDP layouts too": ("--layout zero1 only",
                                                         "torch.optim.AdamW"),
    "offload_wrapper instead of checkpoint_wrapper": ("offload_wrapper", "host memory",
                                                      "checkpoint_wrapper(block)"),
    "the ModuleDict of blocks checkpoint-wrapped as one": ("each block of model.layers",
                                                           "not the ModuleDict"),
    "apply_activation_checkpointing returns nothing": ("return model",),
    "apply_fsdp returns nothing": ("return model",),
    "the blocks' names checkpoint-wrapped": ("checkpoint_wrapper(model.layers[name])",),
    "torch.utils.checkpoint.checkpoint as checkpoint_fn (reentrant)": ("checkpoint_fn",
                                                                       "reentrant"),
    "the micro-batches' losses summed, one backward per step": ("backward()",
                                                                "each micro-batch"),
    "the step's last micro-batch counted from the start (syncs once)": ("fewer",
                                                                        "nullcontext() if last"),
    "the loss divided by the ranks instead of the micro-batches": ("args.grad_accum",
                                                                   "not by the ranks"),
    "ZeroRedundancyOptimizer overlapping with DDP": ("overlap_with_ddp",),
    "FSDP's gradient sync switched off and never on again": ("set_requires_gradient_sync(True)",),
    "the backward outside no_gradient_sync": ("backward too",),
    "checkpoint_wrapper without the RNG state (dropout masks differ in recompute)": (
        "preserve_rng_state",),
    "the divided loss divided again for backward": ("1/2 of the whole batch's", "divide it once"),
    "the micro-batches counted from 1 (the first step runs one)": ("after 1 micro-batch",
                                                                   "micro = 0"),
    "the logged loss the mean of the divided micro-batch losses": ("gradients are right",
                                                                   ".sum()"),
    "the step's last micro-batch counted one ahead": (
        "mis-counted", "last = micro % args.grad_accum == 0 right after micro += 1"),
    "FSDP's gradient sync switched off on the root only": ("the blocks", "recurse"),
    "DDP's no_sync() called, not entered": ("with model.no_sync(): yield",),
    "the step's last micro-batch every second one, a 2 written in": (
        "stepped after 2 micro-batches", "never a number written in"),
    "the step's last micro-batch any but the first (right for 2 only)": (
        "--grad-accum 4", "instead of args.grad_accum = 4"),
    "zero_grad every second micro-batch, a 2 written in": ("zero_grad",),
    "zero_grad before the first micro-batch only": (
        "without optimizer.zero_grad() since the step before",),
    "tokens counted for 2 micro-batches, a 2 written in": ("--grad-accum 4", "args.grad_accum"),
    "the stages cut from models of a seed per rank": ("other initial weights",
                                                      "alike on every rank"),
    "the model built from a seed per rank, then sharded": ("other initial weights",
                                                           "FSDP does not"),
    "the model built from a seed per rank, then split": ("other initial weights",),
    "loss_history gets each replica's own loss (the step lines the mean)": (
        "loss_history holds others", "loss_history.append(step_loss)"),
    "local_params counted before apply_tp": ("counted before apply_tp",),
    "the summary's params_per_rank from model.num_params()": ("params_per_rank=local_params",),
    "evaluation samplers given dp_rank and dp_size by position, swapped": (
        "takes the count first", "num_replicas=dp_size, rank=dp_rank"),
    "the training loss divided by the tp degree": ("half one process's", "without / args.tp"),
    "apply_tp without its return model": ("apply_tp returned None", "return model"),
    "--tp parsed by type=int (0 taken)": ("--tp 0", "type=positive_int"),
    "the model built from a seed per rank, sharded in the FSDP layouts": (
        "other initial weights",),
    "DataParallel imported under the name DDP": ("DataParallel", "DistributedDataParallel as DDP"),
    "the batch per rank divided by the ranks": ("batch_size=2", "per rank"),
    "backward on the loss divided by the ranks (DDP averages already)": (
        "0.5 x", "DDP averages the gradients itself"),
    "forward and backward inside model.no_sync()": ("inside model.no_sync()",),
    "set_epoch with the epoch plus the rank": ("rank 1 calls set_epoch(1)",),
    "loss_history gets the loss as a number": ("must stay a tensor",),
    "destroy_process_group() before monitor.close()": ("though `del model` ran",
                                                        "after monitor.close"),
    "a barrier after destroy_process_group()": ("a collective after destroy_process_group()",),
    "the logged loss the maximum over the ranks": ("ReduceOp.MAX", "all_reduce_mean"),
    "the shipped device line left below setup()": ("makes the device again after setup()",),
    "rank set again from SLURM_PROCID after setup()": ("sets it again after setup()",
                                                       "SLURM_PROCID"),
    "the model wrapped in DDP before model.num_params()": ("wrapped in DDP before this line",
                                                           "model.module"),
    "the evaluation's sums reduced inside its batch loop": ("inside the batch loop",
                                                            "after the loop"),
    "the validation loss averaged where evaluate() is called": ("a mean of the ranks' means",
                                                                "inside evaluate()"),
    "the sync switched on every second micro-batch, a 2 written in": (
        "fewer than once per step", "nullcontext() if last"),
    "the test sampler split over the ranks": (
        "different test samples", "DistributedEvalSampler(test_ds, num_replicas=1, rank=0)"),
    "the test sampler counts processes": (
        "different test samples", "num_replicas=dp_size, rank=dp_rank"),
    "evaluation samplers count processes": ("different validation samples",),
}

# Mistakes whose consequences further down the run get no FIX lines of their own: what -> the
# only TODOs that may have one.
ONLY_FIXED = {
    "the profiler stepped again in the report block": {43},
    "the whole model compiled in place (model.compile())": {47},
    # the ranks' weights apart: what they train, evaluate and save waits for the cause
    "DataParallel imported under the name DDP": {1},
    "forward and backward inside model.no_sync()": {5},
    "backward on the loss divided by the ranks (DDP averages already)": {5},
    "the batch per rank divided by the ranks": {4},
    # another order than one process's: the losses and weights wait for TODO 6
    "set_epoch with the number of epochs": {6},
    "set_epoch with the epoch plus the rank": {6},
    # a mix of models: what it trains and saves waits for the seed
    "the stages cut from models of a seed per rank": {36},
    "the model built from a seed per rank, then sharded": {18},
    "the model built from a seed per rank, then split": {28},
    "the model built from a seed per rank, sharded in the FSDP layouts": {56},
    # the evaluation compared with one process's waits for the samplers
    "the test sampler split over the ranks": {35},
    "the test sampler counts processes": {27},
    "evaluation samplers count processes": {27},
    # the stages read other data than one process: 37-40 wait for TODO 35
    "one replica, but the training sampler seeded per rank": {35},
    "the validation sampler with num_replicas=1 but rank=rank": {35},
    # the logged losses and the weights wait for TODO 37; evaluation's autocast is right
    "the training's autocast written out as bf16": {37},
    # each unit reduce-scatters once a step: the blocks' parts counted too (no FIX 58)
    "each block's attention and MLP sharded instead of the block": {18, 56},
    # 13 and 14 read the static rendezvous's --master_addr and --master_port
    "a static rendezvous (--node_rank, --master_addr) for c10d": {15},
    # found by trying new mistakes on the check (2026-11-28): the cause, not its consequences
    "the training sampler without the run's seed": {3},
    "the training sampler left to its defaults for shuffle and seed": {3},
    "DistributedEvalSampler for the training split": {3},
    "the model wrapped in DDP twice": {5},
    "the loss averaged over the ranks before backward": {7},
    "the sharded state dict torch.save-d on rank 0 as the final model": {22},
    "apply_fsdp called without the precision (its default: fp32)": {19},
    "the checkpoints saved without the optimizer": {20},
    # the collectives lesson: a wrong part of the ring is that part's alone
    "the reduce-scatter's steps counted from 1 (one step off)": {50},
    "every step range and every event named all_reduce counted": {54},
    # stages that hold the wrong parts: TODO 37-40's comparisons with one process wait
    "every stage keeps the final norm": {34},
    "the last stage keeps pos_emb": {34},
    "every stage keeps every block": {34},
    "a split that loses a layer": {34},
    "samplers count processes": {27},
    "gpu_busy's two numbers swapped": {59},
    "FLOPs per token as 6 x all parameters (the embedding tables counted)": {42},
    "MFU of the step line from all parameters' FLOPs of its own": {42},
    "MFU divided by the peak in TFLOP/s": {42},
    "a short run's window one step too long": {43},
    "a run too short to profile says nothing": {43},
    "NVTX ranges on every device (a CPU has none)": {44},
    "NVTX ranges started and never ended": {44},
    "the training sampler of one replica (both replicas read the same batches)": {27},
    "the output layer's logits replicated": {24},
    "the loss under loss_parallel kept a DTensor": {30},
    "apply_tp after fully_shard": {28},
    "dp_rank from the tp dim": {26},
    # the evaluation's crash is TODO 33's alone; the training before it is judged on its own
    "evaluation without loss_parallel": {33},
    "evaluate's loss sum kept a DTensor": {33},
    "evaluation's loss taken whole without loss_parallel": {33},
    "samplers count processes, and evaluate's loss sum kept a DTensor": {27, 33},
    "evaluation samplers without num_replicas and rank, and evaluate's loss sum kept a "
    "DTensor": {27, 33},
    "the logits gathered in training, and evaluation without loss_parallel": {30, 33},
    "tokens of one replica, and evaluate's loss sum kept a DTensor": {31, 33},
    "the training loss summed over the replicas, and evaluate's loss sum kept a DTensor": {31, 33},
    "the training loss summed over the replicas": {31},
    "apply_tp leaves tp 1 whole, and the loss's full_tensor() stops the run on two nodes": {30},
    "apply_tp leaves tp 1 whole, and evaluate's full_tensor() stops the run on two nodes": {33},
    "apply_tp leaves tp 1 whole, evaluate stops on two nodes, and the training loss not "
    "averaged": {31, 33},
    "apply_tp leaves tp 1 whole (two nodes stop in training), and evaluate's loss sum kept a "
    "DTensor": {30, 33},
    "the training loss not averaged (each replica logs its own)": {31},
    "evaluate returns the mean of the replicas' means": {33},
    "local_params from the DTensors' global sizes, and evaluate's loss sum kept a DTensor": {
        28, 33},
    "FSDP on the root only, and evaluate's loss sum kept a DTensor": {29, 33},
    "dp_group from the tp dim, and evaluate's loss sum kept a DTensor": {26, 33},
    "the loss averaged over all processes, and evaluate's loss sum kept a DTensor": {31, 33},
    "evaluation samplers of one replica, and evaluate's loss sum kept a DTensor": {27, 33},
    "the embedding not split, and evaluate's loss sum kept a DTensor": {24, 33},
    "evaluate given the dp sub-mesh instead of its group": {33},
    "FSDP on the root only, and evaluate given the dp sub-mesh": {29, 33},
    "evaluate's loss on the local logits (to_local())": {33},
    "tokens of one replica, and evaluate's loss on the local logits": {31, 33},
    "check_tp_degree after the mesh is built": {26},
    "a mesh without dim names": {26},
    "FSDP over the whole 2-D mesh": {29},
    "a vocabulary that is a multiple padded by one more": {60},
    "gpu_busy whenever --profile is given (a short run has no profiler)": {59},
    "resume_checkpoint looks in OUT_DIR, the checkpoints are in OUT_DIR/checkpoints": {21},
    "the string 'false' turned into a bool for apply_fsdp": {19},
    # a train_state key missing: TODO 20's, though the resume that reads it goes wrong too
    "the model's configuration saved as config": {20},
    "the step saved as steps": {20},
    "best_val neither saved nor restored": {20},
    "the best validation loss saved as best_val_loss, read back as best_val": {20},
    "no loss_history in train_state": {20},
    "best_val saved, read back as best_val_loss": {21},
    "no line says where the run resumed": {21},
    "set_epoch on rank 0 only (the shards overlap from the second epoch)": {6},
    "the evaluation samplers given rank and world_size by position": {3},
    "the averaged loss made a number with .item()": {7},
    "the process group destroyed right after the test evaluation": {11},
    "set_epoch(epoch + 1)": {6},  # (TODO 7 and 10 wait: another order than one process's)
    "the loss averaged for the step line only": {7},
    # a sampler of "1 replica" on rank 1 stops the run: TODO 2's world_size, not TODO 3's
    "world_size = 1 left after setup": {2},
    "world_size from LOCAL_WORLD_SIZE (1 on each of two nodes)": {2},
    "--ntasks=1 for the whole job": {15},
    "#SBATCH --gres after the first command": {12},
    "the sampler's rank from the processes, its count from the replicas": {27},  # (TODO 31-33 wait: the replicas train on other data)
    # a bf16 run's policy: TODO 18's alone, though the bf16 run stops in evaluate (TODO 19)
    "the bf16 policy given to the root only (the blocks gather fp32)": {18},
    "the root's logits left in bf16 (no output_dtype)": {18},
    "gradients summed in bf16 (no reduce_dtype)": {18},
    "fp16 for bf16 in the policy (float16 gathered and summed)": {18},
    # ranks trained on the wrong data: the losses and weights differ from one process's, and
    # TODO 7 and 10 wait (they were FIX lines before)
    "every rank's sampler seeded with its rank (the shards overlap)": {3},
    "training sampler with the local rank": {3},
    "training sampler without shuffling": {3},
    "sampler made but not given to the training DataLoader": {4},
    # two ranks without DDP train apart: not a precision mistake (TODO 45)
    "DDP dropped for every world size": {62},
    # a logged loss that is wrong is no training that is wrong (TODO 37)
    "the microbatches' losses summed": {38},
    # a checkpoint that says the wrong place: TODO 20's, though the resume goes wrong too
    "saved inside the step, before its batch is counted": {20},
    "the last checkpoint of an epoch saved as the next epoch's start": {20},
    "saved before step += 1": {20},
    "DDP only where the node has several GPUs": {62},
    "the peak of bf16 written in (an fp32 run's MFU 15 times too small on a GPU)": {42},
    "the peak asked before set_precision (auto: fp32's peak on a GPU in bf16)": {42},
    "the evaluation schedule on the training's stage": {36},
    # a mistake that trains, or evaluates, another way than one process: the comparisons of the
    # other TODOs with one process wait for it
    "the training schedule built with the summing loss": {36},
    "the first and the last stage's parts swapped": {34},
    "the kept blocks renumbered from 0 in a new ModuleDict": {34},
    "no zero_grad before schedule.step": {37},
    "optimizer.step() on the last stage only": {37},
    "schedule.eval without losses=": {40},
    "schedule.eval without target=": {40},
    "evaluation tokens counted on the last stage only": {40},
    "evaluation with the training schedule": {40},
    "the evaluation's microbatch sums averaged": {40},
    "the evaluation stage built on a copy of the model": {36},
    "--layers-per-stage not passed on": {36},
    "the loss broadcast's result assigned": {38},
    "the loss broadcast from each rank's own stage": {38},
    "the evaluation's padded targets 0": {40},
    "the evaluation's padding counted in the tokens": {40},
    "the global batch saved as one rank's batch": {20},
    "the MLP's projections the other way round": {24},
    "k_proj left out of the plan": {24},
    "the embedding's input not replicated": {24},
    "the mesh's names the other way round": {26},
    "dp_group from the tp dim": {26},
    "dp_rank from mesh['dp'].get_rank() (the global rank)": {26},
    "the training loss divided by the tp degree": {30},
    # another --tp than the processes per node: another split of the batch, and TODOs 31-32 wait
    "--tp defaults to 1": {25},
    "--tp defaults to the GPUs of the node": {25},
    "--tp defaults to SLURM_NTASKS_PER_NODE": {25},
    # an import gone before the TODO that replaces the name's use: no FIX for the import TODO
    "DDP's import gone before TODO 29 replaces DDP": set(),
    "all_reduce_mean's import gone before TODO 38 replaces it": set(),
    # a crash midway through split_pipeline_stage is no layout to judge
    "blocks deleted while the loop walks model.layers": {34},
    # a stage that crashed inside evaluate read part of a split: no sampler FIX from it
    "evaluate still runs the model itself (TODO 40 as shipped)": set(),
    # gradients thrown away, or the training outside autocast: TODO 37's alone
    "zero_grad left between schedule.step and optimizer.step": {37},
    "gradients zeroed after the schedule": {37},
    "schedule.step outside the autocast": {37},
    # a send/receive step that breaks (a request dropped unwaited, a neighbour that does not
    # exist): the hang that follows, in the reduce-scatter, is TODO 49's
    "only the last request of batch_isend_irecv waited for": {49},
    "the neighbours without % n (rank n - 1 sends to rank n)": {49},
    # the memory step: a mistake of one option, seen in every run with that option
    "ZeroRedundancyOptimizer for the FSDP layouts too": {57},
    "the ModuleDict of blocks checkpoint-wrapped as one": {55},
    "apply_activation_checkpointing returns nothing": {55},
    "apply_fsdp returns nothing": {56},
    "the blocks' names checkpoint-wrapped": {55},
    "the micro-batches' losses summed, one backward per step": {58},
    "the step's last micro-batch counted from the start (syncs once)": {58},
    "the loss divided by the ranks instead of the micro-batches": {58},
    "the logged loss undivided, backward on the divided loss": {58},
    "the divided loss divided again for backward": {58},
    "the micro-batches counted from 1 (the first step runs one)": {58},
    "the logged loss the mean of the divided micro-batch losses": {58},
    "the step's last micro-batch counted one ahead": {58},
    "FSDP's gradient sync switched off on the root only": {58},
    "DDP's no_sync() called, not entered": {58},
}

# Right solutions written another way: the check must call them all good.
CORRECT = [
    ("ddp", DDP, "the logged loss averaged with ReduceOp.AVG",
     [("import torch.nn.functional as F\n",
       "import torch.nn.functional as F\nimport torch.distributed as dist\n"),
      ("step_loss = all_reduce_mean(loss.detach())",
       "step_loss = loss.detach().clone()\n"
       "            dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)")]),
    ("ddp", DDP, "the detached loss summed in place, then divided by the ranks",
     [("import torch.nn.functional as F\n",
       "import torch.nn.functional as F\nimport torch.distributed as dist\n"),
      ("step_loss = all_reduce_mean(loss.detach())",
       "dist.all_reduce(loss.detach())\n"
       "            step_loss = loss.detach().clone() / world_size")]),
    ("ddp", DDP, "the best validation loss kept on rank 0 alone, around save0",
     [("        if val_loss < best_val:\n            best_val = val_loss\n",
       "        if rank == 0 and val_loss < best_val:\n            best_val = val_loss\n")]),
    ("ddp", DDP, "a seed per rank before the model (DDP broadcasts rank 0's weights)",
     [("    model = TransformerLM(cfg).to(device)\n",
       "    torch.manual_seed(args.seed + rank)\n    model = TransformerLM(cfg).to(device)\n")]),
    ("perf", PERF, "the optimizer's range named after AdamW, the GPU line without 'busy'",
     [('annotate("optimizer", device)', 'annotate("adamw step", device)'),
      ('print0(f"GPU busy: no GPU kernels', 'print0(f"GPU: no GPU kernels'),
      ('print0(f"GPU busy {kernels_ms:.1f} ms', 'print0(f"GPU kernels {kernels_ms:.1f} ms')]),
    ("perf", PERF, "ranges named after the code they wrap",
     [('annotate("forward", device)', 'annotate("model(x) + loss_fn", device)'),
      ('annotate("backward", device)', 'annotate("loss.backward()", device)'),
      ('annotate("optimizer", device)', 'annotate("optimizer.step()", device)'),
      ('annotate("communication", device)', 'annotate("all_reduce_mean(loss)", device)')]),
    ("perf", PERF, "the compiled loss as a function of its own under @torch.compile",
     [("    loss_fn = torch.compile(lm_loss) if args.compile else lm_loss\n",
       "    loss_fn = lm_loss\n    if args.compile:\n        @torch.compile\n"
       "        def loss_fn(logits, targets):\n"
       "            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())\n")]),
    ("fsdp", FSDP, "the checkpoints folder as a string",
     [('resume_checkpoint(args.resume, out_dir / "checkpoints")',
       'resume_checkpoint(args.resume, str(out_dir) + "/checkpoints")')]),
    ("ddp", DDP, "the model and optimizer let go by setting them to None",
     [("    del model, optimizer\n", "    model = optimizer = None\n")]),
    ("fsdp", FSDP, "every unit resharded by name, blocks then root",
     [("    for unit in model.modules():\n        if isinstance(unit, FSDPModule):\n"
       "            unit.reshard()\n",
       "    for block in model.layers.values():\n        block.reshard()\n    model.reshard()\n")]),
    ("ddp", DDP, "imports merged into the existing lines",
     [("from utils.data import IGNORE_INDEX, TokenWindows, check_splits, load_corpus_or_exit, pad_batch",
       "from utils.data import (IGNORE_INDEX, DistributedEvalSampler, TokenWindows, check_splits,\n"
       "                        load_corpus_or_exit, pad_batch)"),
      ("from utils.data import DistributedEvalSampler\n", "")]),
    ("ddp", DDP, "DistributedSampler with its defaults",
     [("DistributedSampler(train_ds, num_replicas=world_size, rank=rank,\n"
       "                                       shuffle=True, seed=args.seed, drop_last=True)",
       "DistributedSampler(train_ds, seed=args.seed, drop_last=True)")]),
    ("ddp", DDP, "the mean of sums over ranks",
     [("loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)",
       "loss_sum, tokens = all_reduce_mean(loss_sum), all_reduce_mean(tokens)")]),
    ("ddp", DDP, "saving the inner module on rank 0 by hand",
     [('    save0(model, out_dir / "final_model.pt")',
       '    if rank == 0:\n        torch.save(model.module.state_dict(), out_dir / "final_model.pt")')]),
    ("ddp", DDP, "the evaluation's sums kept under other names",
     [("    loss_sum, tokens = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n"
       "    model.train()\n    return (loss_sum / tokens).item()",
       "    total, count = all_reduce_sum(loss_sum), all_reduce_sum(tokens)\n"
       "    model.train()\n    return (total / count).item()")]),
    ("ddp", DDP, "the drop_last of the training DataLoader given apart from loader_args",
     [("train_loader = DataLoader(train_ds, sampler=train_sampler, drop_last=True, **loader_args)",
       "train_loader = DataLoader(train_ds, sampler=train_sampler, **loader_args, drop_last=True)")]),
    ("ddp", DDP, "torch.distributed's own teardown",
     [("    destroy_process_group()\n",
       "    import torch.distributed as dist\n    dist.barrier()\n    dist.destroy_process_group()\n")]),
    ("sbatch", SBATCH, "CUDA_VISIBLE_DEVICES left to Slurm", [("export CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS\n", "")]),
    ("sbatch", SBATCH, "the nodes given as -N", [("#SBATCH --nodes=2", "#SBATCH -N 2")]),
    ("sbatch", SBATCH, "the GPUs asked for per task, one task per node",
     [("#SBATCH --gres=gpu:4", "#SBATCH --gpus-per-task=4")]),
    ("sbatch", SBATCH, "srun's CPUs from SRUN_CPUS_PER_TASK",
     [('srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash',
       'export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\nsrun --kill-on-bad-exit=1 bash')]),
    ("sbatch", SBATCH, "torchrun's dashed options",
     [("--nproc_per_node=", "--nproc-per-node="), ("--rdzv_backend=", "--rdzv-backend="),
      ("--rdzv_id=", "--rdzv-id="), ("--rdzv_endpoint=", "--rdzv-endpoint="),
      ("--rdzv_conf=", "--rdzv-conf=")]),
    ("sbatch", SBATCH, "torchrun started as python -m torch.distributed.run",
     [("bash -c 'exec torchrun \\", "bash -c 'exec python -m torch.distributed.run \\")]),
    ("sbatch", SBATCH, "scontrol show hostname (scontrol takes the prefix)",
     [('scontrol show hostnames "$SLURM_JOB_NODELIST"', 'scontrol show hostname "$SLURM_JOB_NODELIST"')]),
    ("sbatch", SBATCH, "the InfiniBand address from getent hosts",
     [("""nslookup "${MASTER_ADDR}${SITE_IB_SUFFIX}" 2>/dev/null | awk '/^Address: / && !n++ {print $2}'""",
       """getent hosts "${MASTER_ADDR}${SITE_IB_SUFFIX}" | awk '!n++ {print $1}'""")]),
    ("fsdp", FSDP, "apply_fsdp with a loop over named children",
     [("    for block in model.layers.values():\n",
       "    for _, block in model.layers.named_children():\n")]),
    ("tp", TP, "apply_tp without reassigning the model",
     [('    model = apply_tp(model, mesh["tp"])\n', '    apply_tp(model, mesh["tp"])\n')]),
    ("tp", TP, "dp_group asked from the whole mesh by name",
     [('dp_group = mesh["dp"].get_group()', 'dp_group = mesh.get_group("dp")')]),
    ("tp", TP, "local_params with hasattr(p, 'to_local')",
     [("local_params = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()\n"
       "                       for p in model.parameters())",
       "local_params = sum((p.to_local() if hasattr(p, 'to_local') else p).numel()\n"
       "                   for p in model.parameters())")]),
    ("tp", TP, "the embedding's output layout spelled out",
     [('"tok_emb": RowwiseParallel(input_layouts=Replicate()),',
       '"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),')]),
    ("fsdp", FSDP, "resume_position with keywords and the batches counted apart",
     [("        step, start_epoch, start_batch = resume_position(train_state, global_batch,\n"
       "                                                         len(train_loader), args.max_steps)",
       "        batches = len(train_loader)\n"
       "        step, start_epoch, start_batch = resume_position(\n"
       "            train_state, global_batch=global_batch, batches_per_epoch=batches,\n"
       "            max_steps=args.max_steps)")]),
    ("fsdp", FSDP, "the best validation loss saved and restored as best_val_loss",
     [("best_val=best_val,", "best_val_loss=best_val,"),
      ('train_state["best_val"]', 'train_state["best_val_loss"]')]),
    ("fsdp", FSDP, "the loss history saved and restored as losses",
     [("loss_history=[loss.item() for loss in loss_history],",
       "losses=[loss.item() for loss in loss_history],"),
      ('train_state["loss_history"]', 'train_state["losses"]')]),
    ("fsdp", FSDP, "where the run resumed said in other words",
     [('print0(f"resumed from {resume} at step {step}, epoch {start_epoch}, batch {start_batch}")',
       'print0(f"continuing at step {step} with the weights of {resume}.")')]),
    ("fsdp", FSDP, 'the FSDP2 names imported from torch.distributed._composable.fsdp',
     [('from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard\n',
       'from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard\n')]),
    ("fsdp", FSDP, 'the blocks sharded in reverse order',
     [('    for block in model.layers.values():\n        fully_shard(block,',
       '    for block in reversed(list(model.layers.values())):\n        fully_shard(block,')]),
    ("fsdp", FSDP, "the resume's batches skipped with enumerate and continue",
     [('        batches_done = start_batch if epoch == start_epoch else 0\n',
       '        batches_done = 0\n'),
      ('        for x, y in monitor.batches(itertools.islice(train_loader, batches_done, None)):\n',
       '        skip = start_batch if epoch == start_epoch else 0\n        for i, (x, y) in enumerate(monitor.batches(iter(train_loader))):\n            if i < skip:\n                batches_done += 1\n                continue\n')]),
    ("fsdp", FSDP, 'every unit resharded with model.apply',
     [('    for unit in model.modules():\n        if isinstance(unit, FSDPModule):\n            unit.reshard()\n',
       '    model.apply(lambda m: m.reshard() if isinstance(m, FSDPModule) else None)\n')]),
    ("fsdp", FSDP, 'the embeddings and the output layer as units of their own',
     [('    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n',
       '    for part in (model.tok_emb, model.pos_emb, model.output):\n        fully_shard(part, mp_policy=MixedPrecisionPolicy(**policy))\n    fully_shard(model, mp_policy=MixedPrecisionPolicy(**policy, output_dtype=torch.float32))\n')]),
    ("tp", TP, "the TP imports merged",
     [("from torch.distributed.tensor import Replicate\n", ""),
      ("from torch.distributed.tensor import DTensor\n",
       "from torch.distributed.tensor import DTensor, Replicate\n")]),
    ("tp", TP, "dp_rank and dp_size asked from the whole mesh by name and index",
     [('dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()',
       'dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)')]),
    ("tp", TP, "dp_rank and dp_size by arithmetic (tp the inner dim)",
     [('dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()',
       "dp_rank, dp_size = rank // args.tp, world_size // args.tp")]),
    ("tp", TP, "the mesh built with keywords, its sub-meshes named once",
     [('    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp),\n'
       '                            mesh_dim_names=("dp", "tp"))\n'
       '    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()\n'
       '    dp_group = mesh["dp"].get_group()\n',
       '    mesh = init_device_mesh(device_type=device.type,\n'
       '                            mesh_shape=(world_size // args.tp, args.tp),\n'
       '                            mesh_dim_names=("dp", "tp"))\n'
       '    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]\n'
       '    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()\n'
       '    dp_group = dp_mesh.get_group()\n'),
      ('model = apply_tp(model, mesh["tp"])', "model = apply_tp(model, tp_mesh)"),
      ('fully_shard(block, mesh=mesh["dp"])', "fully_shard(block, mesh=dp_mesh)"),
      ('fully_shard(model, mesh=mesh["dp"])', "fully_shard(model, mesh=dp_mesh)")]),
    ("tp", TP, "the TP plan as one dict of wildcard names on the model",
     [('    for block in model.layers.values():\n        parallelize_module(block, tp_mesh, {\n'
       '            "attn.q_proj": ColwiseParallel(),   # each rank: n_heads / tp whole heads\n'
       '            "attn.k_proj": ColwiseParallel(),   # (the model\'s view(b, t, -1, head_dim)\n'
       '            "attn.v_proj": ColwiseParallel(),   #  finds the local head count by itself)\n'
       '            "attn.out_proj": RowwiseParallel(),\n'
       '            "mlp.in_proj": ColwiseParallel(),   # each rank: d_ff / tp hidden units\n'
       '            "mlp.out_proj": RowwiseParallel(),\n        })\n'
       '    parallelize_module(model, tp_mesh, {\n',
       '    parallelize_module(model, tp_mesh, {\n'
       '        "layers.*.attn.q_proj": ColwiseParallel(),\n'
       '        "layers.*.attn.k_proj": ColwiseParallel(),\n'
       '        "layers.*.attn.v_proj": ColwiseParallel(),\n'
       '        "layers.*.attn.out_proj": RowwiseParallel(),\n'
       '        "layers.*.mlp.in_proj": ColwiseParallel(),\n'
       '        "layers.*.mlp.out_proj": RowwiseParallel(),\n')]),
    ("tp", TP, "the TP plan applied to attention and the MLP apart",
     [('        parallelize_module(block, tp_mesh, {\n'
       '            "attn.q_proj": ColwiseParallel(),   # each rank: n_heads / tp whole heads\n'
       '            "attn.k_proj": ColwiseParallel(),   # (the model\'s view(b, t, -1, head_dim)\n'
       '            "attn.v_proj": ColwiseParallel(),   #  finds the local head count by itself)\n'
       '            "attn.out_proj": RowwiseParallel(),\n'
       '            "mlp.in_proj": ColwiseParallel(),   # each rank: d_ff / tp hidden units\n'
       '            "mlp.out_proj": RowwiseParallel(),\n        })\n',
       '        attn_plan = {f"{n}_proj": ColwiseParallel() for n in "qkv"}\n'
       '        attn_plan["out_proj"] = RowwiseParallel()\n'
       '        parallelize_module(block.attn, tp_mesh, attn_plan)\n'
       '        parallelize_module(block.mlp, tp_mesh, {"in_proj": ColwiseParallel(),\n'
       '                                                "out_proj": RowwiseParallel()})\n')]),
    ("tp", TP, "zero_grad before loss_parallel, the loss's full_tensor() inside it",
     [("            with loss_parallel():\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                optimizer.zero_grad(set_to_none=True)\n"
       "                loss.backward()\n"
       "            loss = loss.full_tensor()\n",
       "            optimizer.zero_grad(set_to_none=True)\n"
       "            with loss_parallel():\n"
       "                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                loss.backward()\n"
       "                loss = loss.full_tensor()\n")]),
    ("tp", TP, "the loss's value by to_local() (it is replicated)",
     [("            loss = loss.full_tensor()\n", "            loss = loss.to_local()\n")]),
    ("tp", TP, "evaluation sums reduced in one stacked all_reduce_sum",
     [("    loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)\n",
       "    loss_sum, tokens = all_reduce_sum(torch.stack([loss_sum, tokens]), dp_group)\n")]),
    ("tp", TP, "evaluation sums reduced in place with dist.all_reduce on the dp group",
     [("    loss_sum, tokens = all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)\n",
       "    torch.distributed.all_reduce(loss_sum, group=dp_group)\n"
       "    torch.distributed.all_reduce(tokens, group=dp_group)\n")]),
    ("tp", TP, "save_full_model given its path as a string, by keyword",
     [('            save_full_model(model, out_dir / "best_model.pt")',
       '            save_full_model(model, path=str(out_dir / "best_model.pt"))'),
      ('    save_full_model(model, out_dir / "final_model.pt")',
       '    save_full_model(model, os.path.join(args.out_dir, "final_model.pt"))')]),
    ("tp", TP, "evaluate's forward inside loss_parallel too",
     [("        logits = model(x)\n        # DONE 33: loss_parallel, full_tensor()\n"
       "        with loss_parallel():\n",
       "        # DONE 33: loss_parallel, full_tensor()\n"
       "        with loss_parallel():\n            logits = model(x)\n")]),
    ("tp", TP, "--tp's default by os.getenv",
     [('default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),',
       'default=int(os.getenv("LOCAL_WORLD_SIZE", "1")),')]),
    # tp 1 left whole is fine where the loss is taken whole only of a DTensor (the check's
    # two-node run has tp 1)
    ("tp", TP, "apply_tp leaves tp 1 whole, the losses taken whole only of a DTensor",
     [("    for block in model.layers.values():\n        parallelize_module(",
       "    if tp_mesh.size() == 1:  # nothing to split\n        return model\n"
       "    for block in model.layers.values():\n        parallelize_module("),
      ("            loss = loss.full_tensor()\n",
       "            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss\n"),
      ("        with loss_parallel():\n            loss_sum += F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                        "
       "ignore_index=IGNORE_INDEX).full_tensor()",
       "        with loss_parallel():\n            loss = F.cross_entropy(logits.flatten(0, 1), "
       "y.flatten(), reduction=\"sum\",\n                                   "
       "ignore_index=IGNORE_INDEX)\n"
       "        loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss")]),
    ("tp", TP, "evaluate's group as a keyword parameter",
     [("def evaluate(model, loader, device, dp_group):",
       "def evaluate(model, loader, device, group=None):"),
      ("all_reduce_sum(loss_sum, dp_group), all_reduce_sum(tokens, dp_group)",
       "all_reduce_sum(loss_sum, group), all_reduce_sum(tokens, group)"),
      ("val_loss = evaluate(model, val_loader, device, dp_group)",
       "val_loss = evaluate(model, val_loader, device, group=dp_group)"),
      ("test_loss = evaluate(model, test_loader, device, dp_group)",
       "test_loss = evaluate(model, test_loader, device, group=dp_group)")]),
    ("tp", TP, "the training loss summed over dp_group, then divided by dp_size",
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = all_reduce_sum(loss.detach(), dp_group) / dp_size")]),
    ("tp", TP, "the tokens of a step as world_size // args.tp batches",
     [("throughput.step(x.numel() * dp_size)", "throughput.step(x.numel() * world_size // args.tp)")]),
    ("pp", PP, "the stage split by explicit counts",
     [("    owned = stage_layers(len(model.layers), num_stages, layers_per_stage)[stage_index]",
       "    per = len(model.layers) // num_stages\n"
       "    owned = range(stage_index * per, (stage_index + 1) * per)")]),
    ("pp", PP, "evaluation under torch.autocast written out",
     [("        with autocast(precision, device):  # the dtypes the stages send in training\n",
       "        with torch.autocast(device.type, dtype=torch.bfloat16,\n"
       "                            enabled=precision == \"bf16\"):\n")]),
    ("pp", PP, "the evaluation schedule built from --schedule (1F1B evaluates as well)",
     [('eval_schedule = build_schedule("gpipe", eval_stage,',
       "eval_schedule = build_schedule(args.schedule, eval_stage,")]),
    ("pp", PP, "the tokens and targets given to schedule.step on every stage (torch uses them "
     "where they belong)",
     [("                schedule.step(*((x,) if stage.is_first else ()),\n"
       "                              target=y if stage.is_last else None, losses=losses)",
       "                schedule.step(x, target=y, losses=losses)")]),
    ("perf", PERF, "the torch docs' profiler window wait=1 warmup=1 active=3",
     [("PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 1, 2, 3",
       "PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE = 1, 1, 3")]),
    ("perf", PERF, "fused=True everywhere",
     [('fused=device.type == "cuda")', "fused=True)")]),
    ("perf", PERF, "ranges named otherwise",
     [('annotate("forward", device)', 'annotate("fwd pass", device)'),
      ('annotate("backward", device)', 'annotate("bwd pass", device)'),
      ('annotate("optimizer", device)', 'annotate("optimizer step", device)'),
      ('annotate("communication", device)', 'annotate("loss all_reduce", device)')]),
    ("perf", PERF, "GPU time from the CPU step row's device time (its operators' kernels, once)",
     [("    kernels_us = sum(e.self_device_time_total for e in events\n"
       "                     if e.device_type != DeviceType.CPU and not e.is_user_annotation)\n",
       "    kernels_us = sum(e.device_time_total for e in steps)\n")]),
    ("perf", PERF, "the vocabulary padded with math.ceil",
     [("    return -(-vocab_size // multiple) * multiple",
       "    import math\n    return math.ceil(vocab_size / multiple) * multiple")]),
    ("perf", PERF, "the loss compiled with an if statement",
     [("    loss_fn = torch.compile(lm_loss) if args.compile else lm_loss\n",
       "    loss_fn = lm_loss\n    if args.compile:\n        loss_fn = torch.compile(loss_fn)\n")]),
    ("perf", PERF, "the peak's precision by keyword",
     [("peak_flops(device, args.precision)", "peak_flops(device, precision=args.precision)")]),
    ("perf", PERF, "the peak said in GFLOP/s",
     [('print0(f"MFU against {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")',
       'print0(f"MFU divides by {peak / 1e9:.1f} GFLOP/s per device ({peak_source})")')]),
    ("perf", PERF, "NVTX ranges pushed, and popped when the phase ends",
     [("        ranges.enter_context(torch.cuda.nvtx.range(name))\n",
       "        torch.cuda.nvtx.range_push(name)\n"
       "        ranges.callback(torch.cuda.nvtx.range_pop)\n")]),
    ("perf", PERF, "FLOPs per token of all parameters less the two embedding tables, by hand",
     [("flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,",
       "flops_per_token(model.num_params() - model.tok_emb.weight.numel()\n"
       "                                    - model.pos_emb.weight.numel(), cfg.n_layers,")]),
    ("perf", PERF, "FLOPs per token from the weight matrices alone (norms and biases left out)",
     [("flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,",
       "flops_per_token(sum(p.numel() for n, p in model.named_parameters()\n"
       "                                        if p.dim() == 2 and not n.endswith(\"_emb.weight\")),\n"
       "                                    cfg.n_layers,")]),
    ("perf", PERF, "the profiling window shrunk part by part with min()",
     [("    if steps_available >= PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE:\n"
       "        return PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE\n"
       "    if steps_available >= 2:\n"
       "        return 0, 1, steps_available - 1\n"
       "    return None\n",
       "    if steps_available < 2:\n"
       "        return None\n"
       "    wait = min(PROFILE_WAIT, steps_available - 2)\n"
       "    warmup = min(PROFILE_WARMUP, steps_available - wait - 1)\n"
       "    return wait, warmup, min(PROFILE_ACTIVE, steps_available - wait - warmup)\n")]),
    ("perf", PERF, "no profile for a run shorter than the whole window (said so)",
     [("    if steps_available >= 2:\n        return 0, 1, steps_available - 1\n", "")]),
    ("perf", PERF, "MFU computed apart, printed as mfu * 100 with two decimals; tokens/s with a thousands comma",
     [('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       "                mfu = rate * flops_per_tok / (peak * world_size)\n"
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} "\n'
       '                       f"{rate:,.1f} tokens/s MFU {mfu * 100:.2f}%")\n')]),
    ("perf", PERF, "tokens/s in thousands (k tok/s), MFU as a percentage with a space before %",
     [('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       "                mfu = 100 * rate * flops_per_tok / (peak * world_size)\n"
       '                print0(f"epoch {epoch} step {step} | loss {step_loss.item():.4f} | "\n'
       '                       f"{rate / 1e3:.2f}k tok/s | MFU: {mfu:.1f} %")\n')]),
    ("perf", PERF, "MFU printed as a fraction, without %",
     [('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       "                mfu = rate * flops_per_tok / (peak * world_size)\n"
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {mfu:.3f}")\n')]),
    ("perf", PERF, "MFU printed as a percentage under MFU(%), without the sign",
     [('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       "                mfu = 100 * rate * flops_per_tok / (peak * world_size)\n"
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU(%) {mfu:.2f}")\n')]),
    ("perf", PERF, "tokens/s and MFU of a step printed on two lines",
     [('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s")\n'
       '                print0(f"epoch {epoch} step {step} MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n')]),
    ("perf", PERF, "MFU from one rank's rate over one device's peak, tokens/s of all ranks",
     [("            interval_tokens += x.numel() * world_size\n",
       "            interval_tokens += x.numel()\n"),
      ("                rate = interval_tokens / (time.perf_counter() - interval_start)\n",
       "                rank_rate = interval_tokens / (time.perf_counter() - interval_start)\n"
       "                rate = rank_rate * world_size\n"),
      ('                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rate * flops_per_tok / (peak * world_size):.1%}")\n',
       '                print0(f"epoch {epoch} step {step} loss {step_loss.item():.4f} {rate:.0f} tokens/s "\n'
       '                       f"MFU {rank_rate * flops_per_tok / peak:.1%}")\n')]),
    ("perf", PERF, "FLOPs per token by hand from the config (weight matrices and output projection)",
     [("    flops_per_tok = flops_per_token(model.num_params(exclude_embeddings=True), cfg.n_layers,\n"
       "                                    cfg.d_model, cfg.max_seq_len)\n",
       "    n_matmul = (cfg.n_layers * (4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff)\n"
       "                + cfg.d_model * cfg.vocab_size)  # attention, MLP, output projection\n"
       "    flops_per_tok = 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * cfg.max_seq_len\n")]),
    ("perf", PERF, "the window shrunk inside make_profiler, no profiler_window",
     [("    window = profiler_window(steps_available)\n"
       "    if window is None:\n",
       "    wait, warmup, active = PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE\n"
       "    if steps_available < wait + warmup + active:\n"
       "        wait, warmup, active = 0, 1, steps_available - 1\n"
       "    if active < 1:\n"),
      ("    wait, warmup, active = window\n"
       "    activities",
       "    activities")]),
    ("perf", PERF, "a run shorter than the whole window not profiled, said in main",
     [("    profiler = make_profiler(out_dir, rank, device, steps_available) if args.profile else None\n",
       "    profiler = None\n"
       "    if args.profile and steps_available < PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE:\n"
       '        print0(f"--profile: a run of {steps_available} steps is too short to profile")\n'
       "    elif args.profile:\n"
       "        profiler = make_profiler(out_dir, rank, device, steps_available)\n")]),
    ("perf", PERF, "profiler_window asks the process group for the rank",
     [("    if steps_available >= PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE:\n"
       "        return PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE\n"
       "    if steps_available >= 2:\n"
       "        return 0, 1, steps_available - 1\n"
       "    return None\n",
       "    if steps_available >= PROFILE_WAIT + PROFILE_WARMUP + PROFILE_ACTIVE:\n"
       "        return PROFILE_WAIT, PROFILE_WARMUP, PROFILE_ACTIVE\n"
       "    if steps_available >= 2:\n"
       "        if torch.distributed.get_rank() == 0:\n"
       "            print(f'profiling a short run: steps 2 to {steps_available}')\n"
       "        return 0, 1, steps_available - 1\n"
       "    return None\n")]),
    ("perf", PERF, "NVTX ranges pushed and popped in try/finally (annotate a generator)",
     [("def annotate(name: str, device: torch.device):\n"
       "    ranges = contextlib.ExitStack()\n"
       "    ranges.enter_context(record_function(name))\n"
       '    if device.type == "cuda":\n'
       "        ranges.enter_context(torch.cuda.nvtx.range(name))\n"
       "    return ranges\n",
       "@contextlib.contextmanager\n"
       "def annotate(name: str, device: torch.device):\n"
       "    with record_function(name):\n"
       '        if device.type == "cuda":\n'
       "            torch.cuda.nvtx.range_push(name)\n"
       "        try:\n"
       "            yield\n"
       "        finally:\n"
       '            if device.type == "cuda":\n'
       "                torch.cuda.nvtx.range_pop()\n")]),
    ("perf", PERF, "NVTX ranges by range_start and range_end",
     [("def annotate(name: str, device: torch.device):\n"
       "    ranges = contextlib.ExitStack()\n"
       "    ranges.enter_context(record_function(name))\n"
       '    if device.type == "cuda":\n'
       "        ranges.enter_context(torch.cuda.nvtx.range(name))\n"
       "    return ranges\n",
       "@contextlib.contextmanager\n"
       "def annotate(name: str, device: torch.device):\n"
       "    with record_function(name):\n"
       '        handle = torch.cuda.nvtx.range_start(name) if device.type == "cuda" else None\n'
       "        try:\n"
       "            yield\n"
       "        finally:\n"
       "            if handle is not None:\n"
       "                torch.cuda.nvtx.range_end(handle)\n")]),
    ("perf", PERF, "backward and the optimizer step in functions under a decorator of ranges",
     [('            with annotate("backward", device):\n'
       "                loss.backward()\n",
       "            backward(loss)\n"),
      ('            with annotate("optimizer", device):\n'
       "                optimizer.step()\n",
       "            optimizer_step()\n"),
      ("    # ---- training ----\n",
       '    @annotated("backward", device)\n'
       "    def backward(loss):\n"
       "        loss.backward()\n"
       "\n"
       '    @annotated("optimizer", device)\n'
       "    def optimizer_step():\n"
       "        optimizer.step()\n"
       "\n"
       "    # ---- training ----\n"),
      ("def lm_loss(logits, targets):\n",
       "def annotated(name, device):\n"
       '    """annotate() as a decorator"""\n'
       "    def wrap(fn):\n"
       "        fn = record_function(name)(fn)\n"
       '        if device.type == "cuda":\n'
       "            fn = torch.cuda.nvtx.range(name)(fn)\n"
       "        return fn\n"
       "    return wrap\n"
       "\n"
       "\n"
       "def lm_loss(logits, targets):\n")]),
    ("perf-sbatch", PERF_SBATCH, "nsys options spelled out",
     [('-t "${NSYS_TRACE:-cuda,nvtx,nccl}" -o "$OUT_DIR/nsys" --force-overwrite=true',
       '--trace="${NSYS_TRACE:-cuda,nvtx,nccl}" --output="$OUT_DIR/nsys" --force-overwrite true')]),
    # ---- collectives (issue 20) --------------------------------------------------------
    ("collectives", COLL, "isend and irecv on their own",
     [("    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),\n"
       "                                       dist.P2POp(dist.irecv, recv, left)])\n"
       "    for request in requests:\n        request.wait()\n",
       "    sending = dist.isend(send, right)\n    receiving = dist.irecv(recv, left)\n"
       "    sending.wait()\n    receiving.wait()\n")]),
    ("collectives", COLL, "add_ in place",
     [("chunks[into] += received", "chunks[into].add_(received)")]),
    ("collectives", COLL, "the fit by statistics.linear_regression",
     [("""    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True))
             / sum((x - mean_x) ** 2 for x in sizes))
    latency = mean_y - slope * mean_x
""", """    import statistics
    slope, latency = statistics.linear_regression(sizes, seconds)
""")]),
    ("collectives", COLL, "the trace read with a loop in milliseconds",
     [("""    return sum(e["dur"] for e in kernels or gloo) / 1e6 / steps""",
       """    total_ms = 0.0
    for e in kernels or gloo:
        total_ms += e["dur"] / 1000
    return total_ms / steps / 1000""")]),
    ("ddp", DDP, "device_ids from the device itself",
     [('model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)',
       'model = DDP(model, device_ids=[device] if torch.cuda.is_available() else None)')]),
    ("perf", PERF, "fused from the device's name",
     [('fused=device.type == "cuda")', 'fused=str(device).startswith("cuda"))')]),
    ("perf", PERF, "torch.cuda.synchronize written out",
     [("                synchronize(device)\n",
       '                if device.type == "cuda":\n                    torch.cuda.synchronize()\n')]),
    ("perf", PERF, '--compile-mode offering default and reduce-overhead only',
     [('    parser.add_argument("--compile-mode", default=None,\n                        choices=["default", "reduce-overhead", "max-autotune",\n                                 "max-autotune-no-cudagraphs"],\n',
       '    parser.add_argument("--compile-mode", default=None,\n                        choices=["default", "reduce-overhead"],\n')]),
    ("perf", PERF, 'autocast around the backward pass and the optimizer step too',
     [('            with annotate("forward", device), autocast(args.precision, device):\n                logits = model(x)\n                loss = loss_fn(logits, y)\n            optimizer.zero_grad(set_to_none=True)\n            with annotate("backward", device):\n                loss.backward()\n            with annotate("optimizer", device):\n                optimizer.step()\n',
       '            with autocast(args.precision, device):\n                with annotate("forward", device):\n                    logits = model(x)\n                    loss = loss_fn(logits, y)\n                optimizer.zero_grad(set_to_none=True)\n                with annotate("backward", device):\n                    loss.backward()\n                with annotate("optimizer", device):\n                    optimizer.step()\n')]),
    ("perf", PERF, 'gpu_busy read before profiler.stop()',
     [('    if profiler is not None:\n        profiler.stop()\n',
       '    if profiler is not None:\n        busy = gpu_busy(profiler)\n        profiler.stop()\n'),
      ('        kernels_ms, step_ms = gpu_busy(profiler)\n',
       '        kernels_ms, step_ms = busy\n')]),
    ("perf", PERF, 'profiler.step() at the top of the step',
     [('            if profiler is not None:\n                profiler.step()\n',
       ''),
      ('            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n',
       '            if profiler is not None:\n                profiler.step()\n            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n')]),
    ("tp", TP, "the loss reduced with dist.all_reduce on the dp group",
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = loss.detach().clone()\n"
       "            torch.distributed.all_reduce(step_loss, group=dp_group)\n"
       "            step_loss /= dp_size")]),
    ("tp", TP, "init_device_mesh imported from torch.distributed.tensor",
     [("from torch.distributed.device_mesh import init_device_mesh\n", ""),
      ("from torch.distributed.tensor import Replicate\n",
       "from torch.distributed.tensor import Replicate, init_device_mesh\n")]),
    ("tp", TP, "the DeviceMesh built by hand",
     [("from torch.distributed.device_mesh import init_device_mesh\n",
       "from torch.distributed.device_mesh import DeviceMesh\n"),
      ('    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp),\n'
       '                            mesh_dim_names=("dp", "tp"))\n',
       '    mesh = DeviceMesh(device.type, torch.arange(world_size).view(-1, args.tp),\n'
       '                      mesh_dim_names=("dp", "tp"))\n')]),
    ("collectives", COLL, "the fit by numpy.polyfit",
     [("""    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True))
             / sum((x - mean_x) ** 2 for x in sizes))
    latency = mean_y - slope * mean_x
""", """    import numpy
    slope, latency = (float(v) for v in numpy.polyfit(sizes, seconds, 1))
""")]),
    ("memory", MEM, "DDP's no_sync and FSDP2's own switch written out in the loop",
     [("            with contextlib.nullcontext() if last else no_gradient_sync(model):\n",
       "            if isinstance(model, DDP):\n"
       "                context = contextlib.nullcontext() if last else model.no_sync()\n"
       "            else:\n"
       "                model.set_requires_gradient_sync(last)\n"
       "                context = contextlib.nullcontext()\n"
       "            with context:\n")]),
    ("memory", MEM, "nanoGPT's require_backward_grad_sync",
     [("            with contextlib.nullcontext() if last else no_gradient_sync(model):\n",
       "            if isinstance(model, DDP):  # DDP reads it in forward\n"
       "                model.require_backward_grad_sync = last\n"
       "            else:\n"
       "                model.set_requires_gradient_sync(last)\n"
       "            with contextlib.nullcontext():\n")]),
    ("memory", MEM, "torch's own apply_activation_checkpointing on the blocks",
     [("    for name in list(model.layers):\n"
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])\n"
       "    return model",
       "    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
       "        apply_activation_checkpointing as wrap_modules)\n"
       "    blocks = set(model.layers.values())\n"
       "    wrap_modules(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
       "                 check_fn=lambda module: module in blocks)\n"
       "    return model")]),
    ("memory", MEM, "the loss divided after the autocast block",
     [("                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum\n",
       "                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())\n"
       "                loss = loss / args.grad_accum\n")]),
    ("memory", MEM, "the blocks checkpointed by torch.utils.checkpoint in a module of its own",
     [("    for name in list(model.layers):\n"
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])\n"
       "    return model",
       "    class Checkpointed(torch.nn.Module):\n"
       "        def __init__(self, block):\n"
       "            super().__init__()\n"
       "            self.block = block\n\n"
       "        def forward(self, x):\n"
       "            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)\n\n"
       "    for name in list(model.layers):\n"
       "        model.layers[name] = Checkpointed(model.layers[name])\n"
       "    return model")]),
    ("memory", MEM, "the blocks wrapped by key and value",
     [("    for name in list(model.layers):\n"
       "        model.layers[name] = checkpoint_wrapper(model.layers[name])",
       "    for name, block in list(model.layers.items()):\n"
       "        model.layers[name] = checkpoint_wrapper(block)")]),
    ("memory", MEM, "ZeroRedundancyOptimizer with its arguments spelt out",
     [("optimizer_class=torch.optim.AdamW,\n                                            **adamw)",
       "optimizer_class=torch.optim.AdamW,\n"
       "                                            lr=args.lr, weight_decay=args.weight_decay)")]),
    ("memory", MEM, "the FSDP options written out per layout",
     [('    options = dict(reshard_after_forward=layout != "zero2")\n',
       '    options = {"reshard_after_forward": layout in ("zero3", "offload")}\n')]),
    ("memory", MEM, "every Block module sharded, inside its checkpoint_wrapper too",
     [("    for block in model.layers.values():\n        fully_shard(block, **options)\n",
       "    from model.transformer import Block\n"
       "    for block in [m for m in model.modules() if isinstance(m, Block)]:\n"
       "        fully_shard(block, **options)\n")]),
    ("memory", MEM, "zero_grad right after optimizer.step() (the monitor reads no gradients)",
     [("            if micro % args.grad_accum == 0:  # a new optimizer step begins\n"
       "                optimizer.zero_grad(set_to_none=True)\n", ""),
      ("            optimizer.step()\n            step += 1\n",
       "            optimizer.step()\n            optimizer.zero_grad()\n            step += 1\n")]),
]

# Job files without TODOs (collectives.sbatch, preflight.sbatch): a mistake is named on the job
# file's own line, by `python check.py sbatch FILE` and, for collectives.sbatch, by
# `python check.py collectives` too.   (step, job file, what goes wrong, [(old, new), ...])
JOB_FILE_MISTAKES = [
    ("sbatch", "collectives.sbatch", "the GPUs counted by $SLURM_GPUS_PER_NODE inside bash -c",
     [('--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC_PER_NODE"',
       '--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$SLURM_GPUS_PER_NODE"')]),
    ("collectives", "collectives.sbatch", "the GPUs counted by $SLURM_GPUS_PER_NODE inside bash -c",
     [('--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC_PER_NODE"',
       '--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$SLURM_GPUS_PER_NODE"')]),
    ("collectives", "collectives.sbatch", "$SLURM_GPUS_PER_NODE on one node, under set -u",
     [('torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" "$@"',
       'torchrun --standalone --nproc_per_node="$SLURM_GPUS_PER_NODE" "$@"')]),
    ("sbatch", "preflight.sbatch", "one process per node in the rendezvous test",
     [('--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC_PER_NODE"',
       '--nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node=1')]),
    ("sbatch", "collectives.sbatch", "$SITE_GPU_IDS used before the site profile is sourced",
     [("export CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS  # every GPU of the node, as in every job file\n",
       ""),
      ("set -euo pipefail\n", "set -euo pipefail\nexport CUDA_VISIBLE_DEVICES=$SITE_GPU_IDS\n")]),
]
JOB_FILE_CORRECT = [
    ("sbatch", "collectives.sbatch", "the processes per node from Slurm's SLURM_GPUS_ON_NODE",
     [("export NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}",
       "export NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-gpu}}")]),
]
