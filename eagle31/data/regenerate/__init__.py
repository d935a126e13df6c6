"""Regeneration: a conversation dataset's assistant turns replaced by the target's own replies.

    backend = HFBackend(target_dir, settings)                      # the target in this process
    backend = EndpointBackend("http://host:8000/v1", settings)     # a vLLM / SGLang server
    counts = regenerate(conversations, backend, out_dir, settings, rank=0, world_size=1)

A drafter learns the target's distribution; trained on another model's answers (ShareGPT
holds ChatGPT's), its labels disagree with what the target will write at serving time.
Regeneration keeps the users' messages (and a leading system message, else one of
`settings.system_prompts`, drawn per conversation: the prompt training will render) and asks the target for every
assistant turn, turn by turn: the prompt of turn `j` is the conversation so far *as
regenerated*, reasoning included, rendered with the target's chat template and
`settings.chat_template_kwargs` (by the HF tokenizer in-process, by the server for an
endpoint), or with one of `settings.chat_template_variants` drawn per conversation (as the system
prompt is), which its record keeps as `chat_template_kwargs` so that prepare renders it as it was
answered. Replies are greedy when `temperature == 0`, else sampled with a seed per request,
derived from `settings.seed`, the conversation's index in the input and the turn, so that
a resumed run, another rank split or another concurrency samples the same replies.

A reply is (reasoning, answer): an endpoint returns the reasoning its server's reasoning
parser split off (`message.reasoning` in vLLM 0.33, `message.reasoning_content` in SGLang
and older vLLM); the HF backend splits the generated tokens on the template's think
markers. The reasoning is stored as the assistant message's `reasoning_content`, which
prepare renders with the target's template (`eagle31.data.chat`).

A conversation is dropped when it has no user turn (`no_user_turn`), carries tool turns
(`tool_turns`: their results cannot be regenerated), or its first prompt does not fit the
context (`prompt_too_long`: for an endpoint, only the server's own context-length error).
A reply cut at `max_new_tokens` (`finish_reason=length`) is handled by `on_length`:
`drop` ends the conversation before that turn (dropped `reply_cut` when it is the first),
`keep` stores the turn with `finish_reason: "length"` (prepare leaves the end of turn that
the target never wrote unsupervised) and ends the conversation there. A later prompt that
does not fit truncates the conversation to its complete turns. Each is counted.

Requests: one pool of `backend.workers` conversations in flight across all of this rank's
shards (each conversation's turns in order, conversations never waiting for each other);
the first request goes first and the others wait for its answer (up to a second: an engine
refuses a request when it validates it, before generating), so that a server refusing
requests (an HTTP 4xx other than its context-length error: an unknown parameter, a template
error) stops the run in one line (`ServerRefusedError`) before any shard is written. Connection errors, time-outs, 5xx
and 429 answers are retried with back-off until `retries` retries are used and the
server has been failing for `restart_window_s`; then `RegenerateError`.

Output (`out_dir`, the format `eagle31.data.sources` and data_prep/prepare.py read):

    conversations/shard-00000.jsonl   {"messages": [...], "source": "<where>"} per conversation
    stats/shard-00000.json            that shard's counts (written just before its JSONL)
    settings.json                     what the replies depend on; a rerun with others is refused
    report.json                       totals over the shards (`write_report`)

The input, in order, is cut into shards of `shard_size` conversations; rank `r` of `W`
takes shards `r, r+W, ...`. A shard is written, atomically, only when each of its
conversations is answered or dropped for a counted reason, so a killed or failed run
resumes by redoing exactly the shards that are missing. A shard's stats record the content of
the conversations it was made from: a rerun over a source edited since is refused.
"""
