"""The behaviour log-probs by hand: what every engine must return for the tokens it sampled."""

import torch


def processed_logprobs_by_hand(model, output, completion_mask, settings):
    """`(N, T)` log-probs of each completion token under the distribution it was drawn from:
    the model's logits at that position divided by the temperature, filtered by top-k, then by
    top-p (the smallest set of most likely tokens whose probability reaches top_p), and
    renormalised over the tokens kept. One forward pass over prompt and completion, then a plain
    loop over rows and steps. `output`: an engine's `(prompt_ids, prompt_mask,
    completion_ids, ...)`; steps outside `completion_mask` `(N, T)` are 0. `settings`:
    `temperature`, `top_k` (0: none), `top_p`."""
    prompt_ids, prompt_mask, completion_ids = output[:3]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, P + T)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # as `generate` counts them
    with torch.no_grad():
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits.double()  # (N, P + T, V)
    prompt_length = prompt_ids.shape[1]
    result = torch.zeros(completion_ids.shape, dtype=torch.float64)
    for row in range(completion_ids.shape[0]):
        for step in range(int(completion_mask[row].sum())):
            scaled = logits[row, prompt_length + step - 1] / settings["temperature"]  # (V,)
            order = scaled.argsort(descending=True)  # most likely first
            kept = order[: settings["top_k"]] if settings.get("top_k") else order
            probs = scaled[kept].softmax(dim=0)
            # top-p: a token stays while the tokens more likely than it hold less than top_p
            above = probs.cumsum(dim=0) - probs
            nucleus = kept[above < settings.get("top_p", 1.0)].tolist()
            token = int(completion_ids[row, step])
            assert token in nucleus, f"row {row} step {step}: token {token} was filtered out"
            result[row, step] = scaled[token] - scaled[nucleus].logsumexp(dim=0)
    return result
