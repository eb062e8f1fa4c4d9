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
    ("sbatch", SBATCH, "srun without --cpus-per-task", 15,
     [('srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash',
       "srun --kill-on-bad-exit=1 bash")]),
    ("sbatch", SBATCH, "--nproc_per_node=4 written out", 15,
     [('--nproc_per_node="$NPROC_PER_NODE"', "--nproc_per_node=4")]),
    ("sbatch", SBATCH, "one node", 16, [("#SBATCH --nodes=2", "#SBATCH --nodes=1")]),
    ("sbatch", SBATCH, "four nodes", 16, [("#SBATCH --nodes=2", "#SBATCH --nodes=4")]),
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
    ("fsdp", FSDP, "resume_checkpoint looks in OUT_DIR, the checkpoints are in OUT_DIR/checkpoints", 21,
     [('resume_checkpoint(args.resume, out_dir / "checkpoints")', "resume_checkpoint(args.resume, out_dir)")]),
    ("fsdp", FSDP, "the string 'false' turned into a bool for apply_fsdp", 19,
     [('args.reshard_after_forward == "true")', "bool(args.reshard_after_forward))")]),
    ("fsdp", FSDP, "loss_history restored as floats", 21,
     [('loss_history = [torch.tensor(loss, device=device) for loss in train_state["loss_history"]]',
       'loss_history = train_state["loss_history"]')]),
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
     [("        if len(x) < loader.batch_size:\n", "        if False:\n")]),
    ("pp", PP, "training mode not restored after evaluation", 40,
     [("    model.train()\n    return (loss_sum / tokens).item()",
       "    return (loss_sum / tokens).item()")]),
    ("pp", PP, "the loss broadcast on the last stage only", 38,  # the ranks wait apart
     [("            dist.broadcast(step_loss, src=num_stages - 1)",
       "            if stage.is_last:\n                dist.broadcast(step_loss, src=num_stages - 1)")]),
    # ---- the performance step ----------------------------------------------------------
    ("perf", PERF, "peak_flops and synchronize not imported", 41,
     [("from utils.metrics import peak_flops, synchronize\n", "")]),
    ("perf", PERF, "contextlib not imported", 41, [("import contextlib\n", "")]),
    ("perf", PERF, "a clock read without synchronize", 42,
     [("                synchronize(device)\n", "")]),
    ("perf", PERF, "the interval never restarted after a report", 42,
     [("                interval_tokens, interval_start = 0, time.perf_counter()\n", "")]),
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
     [('e.key.startswith("ProfilerStep")]', 'e.key.startswith("ProfilerStep#")]')]),
    ("perf", PERF, "GPU time summed with the operators inside each other", 59,
     [("kernels_us = sum(e.self_device_time_total for e in events)",
       "kernels_us = sum(e.device_time_total for e in events)")]),
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
]

# Words the FIX line of a mistake must hold (what to change, named): what -> words.
MESSAGES = {
    "samplers count processes": ("num_replicas=dp_size, rank=dp_rank",),
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
    "the sampler's rank from the processes, its count from the replicas": (
        "Invalid rank 1", "rank=dp_rank"),
    "every stage keeps the final norm": ("stage 0 keeps norm",),
    "the bf16 policy given to the root only (the blocks gather fp32)": (
        "the blocks gather fp32 weights", "reduce_dtype=torch.float32"),
    "the root's logits left in bf16 (no output_dtype)": ("output_dtype=torch.float32",),
    "gradients summed in bf16 (no reduce_dtype)": ("summed in bf16",),
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
    "the loss divided by the micro-batches and by the ranks": ("in every run", "0.5 x",
                                                                "args.grad_accum only"),
    "the reentrant checkpointing": ("non-reentrant",),
    "no_sync on rank 0 only": ("same micro-batches on every rank",),
    "optimizer.step() every micro-batch": ("optimizer.step() ran", "once per micro-batch"),
    "zero_grad every micro-batch": ("zero_grad() ran between the micro-batches",),
    "the receive buffer float32 for float64 chunks": ("dtype", "torch.empty_like(chunks[into])"),
    "rank 0 makes one all-gather step fewer": ("rank 0 made 1", "range(n - 1)"),
    "the latency returned in milliseconds": ("milliseconds: return seconds",),
    "the bus bandwidth in bits per second": ("not bits",),
    "device_ids by the global rank (GPU 2 on a node of 2)": ("2 nodes x 2 GPUs",
                                                             "device_ids=[local_rank]"),
    "the clock read before synchronize": ("synchronize(device)",),
    "the profiler records the CPU only, also on a GPU": ("ProfilerActivity.CUDA",),
    "set_precision's answer not kept (auto stays auto)": ("args.precision = set_precision",),
    "fused when the device equals the string 'cuda'": ("on a GPU", "fused=False"),
    "the loss averaged over all processes, TP copies included": ("group=dp_group",),
    "the sums over ranks thrown away (taken for in place)": ("new tensor",
                                                            "= all_reduce_sum(loss_sum)"),
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
    "the embedding's input not replicated": ("input_layouts=Replicate()",),
    "--tp defaults to LOCAL_WORLD_SIZE without a fallback": ("os.environ.get('LOCAL_WORLD_SIZE', 1)",),
    "the mesh's names the other way round": ("mesh_dim_names=('dp', 'tp')",),
    "dp_group from the tp dim": ("mesh['dp'].get_group()",),
    "local_params from the DTensors' global sizes": ("to_local().numel()",),
    "the blocks sharded without the dp mesh": ("mesh=mesh['dp']",),
    "the loss broadcast on the last stage only": ("different collectives",),
}

# Mistakes whose consequences further down the run get no FIX lines of their own: what -> the
# only TODOs that may have one.
ONLY_FIXED = {
    # stages that hold the wrong parts: TODO 37-40's comparisons with one process wait
    "every stage keeps the final norm": {34},
    "the last stage keeps pos_emb": {34},
    "every stage keeps every block": {34},
    "a split that loses a layer": {34},
    "samplers count processes": {27},
    "FSDP over the whole 2-D mesh": {29},
    "a vocabulary that is a multiple padded by one more": {60},
    "gpu_busy whenever --profile is given (a short run has no profiler)": {59},
    "resume_checkpoint looks in OUT_DIR, the checkpoints are in OUT_DIR/checkpoints": {21},
    "the string 'false' turned into a bool for apply_fsdp": {19},
    "set_epoch on rank 0 only (the shards overlap from the second epoch)": {6},
    "the sampler's rank from the processes, its count from the replicas": {27},  # (TODO 31-33 wait: the replicas train on other data)
    # a bf16 run's policy: TODO 18's alone, though the bf16 run stops in evaluate (TODO 19)
    "the bf16 policy given to the root only (the blocks gather fp32)": {18},
    "the root's logits left in bf16 (no output_dtype)": {18},
    "gradients summed in bf16 (no reduce_dtype)": {18},
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
    "the global batch saved as one rank's batch": {20},
    "the MLP's projections the other way round": {24},
    "k_proj left out of the plan": {24},
    "the embedding's input not replicated": {24},
    "the mesh's names the other way round": {26},
    "dp_group from the tp dim": {26},
}

# Right solutions written another way: the check must call them all good.
CORRECT = [
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
    ("sbatch", SBATCH, "srun's CPUs from SRUN_CPUS_PER_TASK",
     [('srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash',
       'export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\nsrun --kill-on-bad-exit=1 bash')]),
    ("sbatch", SBATCH, "torchrun's dashed options",
     [("--nproc_per_node=", "--nproc-per-node="), ("--rdzv_backend=", "--rdzv-backend="),
      ("--rdzv_id=", "--rdzv-id="), ("--rdzv_endpoint=", "--rdzv-endpoint="),
      ("--rdzv_conf=", "--rdzv-conf=")]),
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
    ("tp", TP, "the TP imports merged",
     [("from torch.distributed.tensor import Replicate\n", ""),
      ("from torch.distributed.tensor import DTensor\n",
       "from torch.distributed.tensor import DTensor, Replicate\n")]),
    ("pp", PP, "the stage split by explicit counts",
     [("    owned = stage_layers(len(model.layers), num_stages, layers_per_stage)[stage_index]",
       "    per = len(model.layers) // num_stages\n"
       "    owned = range(stage_index * per, (stage_index + 1) * per)")]),
    ("pp", PP, "evaluation under torch.autocast written out",
     [("        with autocast(precision, device):  # the dtypes the stages send in training\n",
       "        with torch.autocast(device.type, dtype=torch.bfloat16,\n"
       "                            enabled=precision == \"bf16\"):\n")]),
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
    ("perf", PERF, "GPU time from the steps' own rows",
     [("    kernels_us = sum(e.self_device_time_total for e in events)\n",
       "    kernels_us = sum(e.device_time_total for e in events\n"
       "                     if e.key.startswith(\"ProfilerStep\"))\n")]),
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
    ("tp", TP, "the loss reduced with dist.all_reduce on the dp group",
     [("step_loss = all_reduce_mean(loss.detach(), group=dp_group)",
       "step_loss = loss.detach().clone()\n"
       "            torch.distributed.all_reduce(step_loss, group=dp_group)\n"
       "            step_loss /= dp_size")]),
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
]
JOB_FILE_CORRECT = [
    ("sbatch", "collectives.sbatch", "the processes per node from Slurm's SLURM_GPUS_ON_NODE",
     [("export NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}",
       "export NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-gpu}}")]),
]
