"""The clock cycle, from a queued request to its answer.

- Planning (no device): `scheduler.ClockCycleScheduler` composes the runs' `seq_id` queues
  (`run_queues`), the prefix rule (`cycle_prefix`), fair share (`fair_share`) and the gather
  window (`gather_window`) into a `cycle_plan.CyclePlan`;
- Running: `device_loop.DeviceLoop`, the one thread on the device, runs each plan through
  `worker.TrainingWorker`: the compute requests (`compute_requests`, reruns in halves when a pass
  fails: `isolation`; requests in parts: `request_parts`), the optimizer steps (`optim_steps`)
  and the saves and loads (`tail_requests`); whose fault a failure is (`request_failures`).

May import sampling/ (to tell the sampler of new weights), checkpoints/, runtime/ and below.
The planning modules never import the running ones or the runtime.
"""
