"""normgrad.torch.patch: which layers it replaces and how (the same Parameter objects, the same
state_dict, settings by family, overrides, what it leaves alone), and small Llama- and
Gemma-style decoders trained a few steps with their own RMSNorm layers and again patched, whose
losses agree step by step."""

import copy
import math
import sys
import unittest

from server_process import CpuServerFixture

try:
    import torch
    import torch.nn.functional as F
    import normgrad.torch as ngt
except ImportError:
    torch = None

# Largest relative difference between the local and the patched loss at any step. Both run the
# same float32 forward; the backward differs only in float32 rounding (sum order, 1/rms against
# rsqrt): about 1e-7 relative per gradient, which five steps of SGD carry into the loss at a
# similar size. A gradient off by 1e-3 moves the losses by more than this.
LOSS_RTOL = 1e-4


if torch is not None:
    class LlamaRMSNorm(torch.nn.Module):
        """Hugging Face transformers' LlamaRMSNorm."""

        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class GemmaRMSNorm(torch.nn.Module):
        """Hugging Face transformers' GemmaRMSNorm: weight from zeros, scale 1 + weight."""

        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.zeros(dim))

        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

        def forward(self, x):
            output = self._norm(x.float())
            output = output * (1.0 + self.weight.float())
            return output.type_as(x)

    class T5LayerNorm(LlamaRMSNorm):
        """Hugging Face transformers' T5LayerNorm (an RMSNorm without mean subtraction)."""

        def forward(self, hidden_states):
            variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states

    class ScaleFreeRMSNorm(torch.nn.Module):
        """An RMSNorm without weight."""

        def __init__(self, eps=1e-5):
            super().__init__()
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    class BiasedRMSNorm(LlamaRMSNorm):
        """An RMSNorm with a bias: not a structure patch knows."""

        def __init__(self, hidden_size):
            super().__init__(hidden_size)
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size))

        def forward(self, x):
            return super().forward(x) + self.bias

    class Attention(torch.nn.Module):
        """Causal multi-head self-attention without rotary embeddings."""

        def __init__(self, hidden, heads):
            super().__init__()
            self.heads = heads
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
                torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))

        def forward(self, x):
            batch, length, hidden = x.shape
            q, k, v = (p(x).view(batch, length, self.heads, -1).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            out = scores.softmax(-1) @ v
            return self.o_proj(out.transpose(1, 2).reshape(batch, length, hidden))

    class GatedMlp(torch.nn.Module):
        """SwiGLU (Llama: SiLU) or GeGLU (Gemma: tanh-approximated GELU)."""

        def __init__(self, hidden, intermediate, activation):
            super().__init__()
            self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
            self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
            self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
            self.activation = activation

        def forward(self, x):
            return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(torch.nn.Module):
        def __init__(self, hidden, heads, intermediate, norm, activation):
            super().__init__()
            self.input_layernorm = norm(hidden)
            self.self_attn = Attention(hidden, heads)
            self.post_attention_layernorm = norm(hidden)
            self.mlp = GatedMlp(hidden, intermediate, activation)

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class DecoderForCausalLM(torch.nn.Module):
        """Embedding, pre-norm decoder layers, a final norm, an LM head."""

        norm_class = None
        activation = None
        embedding_scale = False

        def __init__(self, vocab=48, hidden=32, heads=2, intermediate=64, layers=2):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(vocab, hidden)
            self.layers = torch.nn.ModuleList(
                DecoderLayer(hidden, heads, intermediate, self.norm_class, self.activation)
                for _ in range(layers))
            self.norm = self.norm_class(hidden)
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens)
            if self.embedding_scale:  # Gemma scales the embeddings by sqrt(hidden)
                x = x * math.sqrt(x.shape[-1])
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    class LlamaForCausalLM(DecoderForCausalLM):
        norm_class = LlamaRMSNorm
        activation = staticmethod(F.silu)

    class GemmaForCausalLM(DecoderForCausalLM):
        norm_class = GemmaRMSNorm
        activation = staticmethod(lambda x: F.gelu(x, approximate="tanh"))
        embedding_scale = True

    def norm_weights(model):
        return {name: module.weight for name, module in model.named_modules()
                if "norm" in name.split(".")[-1]}


@unittest.skipIf(torch is None, "torch is not installed")
class PatchTest(CpuServerFixture, unittest.TestCase):
    def test_keeps_the_parameter_objects_and_the_state_dict(self):
        torch.manual_seed(0)
        model = LlamaForCausalLM()
        weights = norm_weights(model)
        state = {key: value.clone() for key, value in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        result = ngt.patch(model, client=self.client)
        self.assertEqual(sorted(name for name, _, _ in result.replaced), sorted(weights))
        self.assertEqual(result.left_alone, [])
        for name, weight in weights.items():
            layer = model.get_submodule(name)
            self.assertIsInstance(layer, ngt.RMSNorm)
            self.assertIs(layer.weight, weight)
        self.assertEqual(list(model.state_dict()), list(state))
        for key, value in model.state_dict().items():
            self.assertTrue(torch.equal(value, state[key]), key)
        # The optimizer made before the patch updates the layers' weights.
        tokens = torch.randint(0, 48, (2, 5))
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        self.assertIsNotNone(weights["norm"].grad)
        before = weights["norm"].detach().clone()
        optimizer.step()
        self.assertFalse(torch.equal(weights["norm"], before))
        model.load_state_dict(state)  # the old state_dict loads into the patched model
        self.assertTrue(torch.equal(weights["norm"], before))

    def test_settings_by_family(self):
        llama = ngt.patch(LlamaForCausalLM(), client=self.client)
        gemma = ngt.patch(GemmaForCausalLM(), client=self.client)
        self.assertEqual({(c, s["offset"], s["casting_mode"]) for _, c, s in llama.replaced},
                         {("LlamaRMSNorm", 0.0, "llama")})
        self.assertEqual({(c, s["offset"], s["casting_mode"]) for _, c, s in gemma.replaced},
                         {("GemmaRMSNorm", 1.0, "gemma")})
        self.assertEqual(len(gemma.replaced), 5)
        self.assertEqual(gemma.replaced[0][2]["eps"], 1e-6)

    def test_same_forward_as_the_replaced_layers(self):
        torch.manual_seed(1)
        x = torch.randn(3, 4, 40)
        for layer in (LlamaRMSNorm(40, 1e-5), GemmaRMSNorm(40), T5LayerNorm(40),
                      ScaleFreeRMSNorm()):
            with self.subTest(layer=type(layer).__name__):
                if hasattr(layer, "weight"):
                    with torch.no_grad():
                        layer.weight.add_(0.1 * torch.randn(40))
                model = torch.nn.Sequential(layer)
                want = model(x)
                result = ngt.patch(model, client=self.client)
                self.assertEqual(len(result.replaced), 1)
                self.assertIsInstance(model[0], ngt.RMSNorm)
                torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-6)

    def test_without_weight(self):
        model = torch.nn.Sequential(ScaleFreeRMSNorm(eps=1e-5))
        result = ngt.patch(model, client=self.client)
        self.assertEqual(result.replaced, [("0", "ScaleFreeRMSNorm", {
            "eps": 1e-5, "offset": 0.0, "casting_mode": "llama", "in_place": False,
            "elementwise_affine": False})])
        self.assertIsNone(model[0].weight)
        self.assertEqual(list(model.state_dict()), [])
        x = torch.randn(2, 16, requires_grad=True)
        model(x).pow(2).sum().backward()
        self.assertEqual(x.grad.shape, x.shape)

    def test_overrides_win(self):
        model = GemmaForCausalLM()
        result = ngt.patch(model, client=self.client, casting_mode="none", offset=0.5,
                           in_place=True, eps=1e-5)
        for _, _, settings in result.replaced:
            self.assertEqual(settings, {"eps": 1e-5, "offset": 0.5, "casting_mode": "none",
                                        "in_place": True, "elementwise_affine": True})
        self.assertEqual(model.norm.casting_mode, "none")
        self.assertTrue(model.norm.in_place)
        with self.assertRaisesRegex(TypeError, "unknown override casting"):
            ngt.patch(GemmaForCausalLM(), client=self.client, casting="none")
        with self.assertRaisesRegex(ValueError, "^casting_mode: 'fp32'"):
            ngt.patch(GemmaForCausalLM(), client=self.client, casting_mode="fp32")

    def test_unknown_norm_layers_are_left_alone_and_listed(self):
        model = torch.nn.Sequential(LlamaRMSNorm(8), torch.nn.LayerNorm(8), BiasedRMSNorm(8),
                                    torch.nn.Linear(8, 8))
        layer_norm, biased = model[1], model[2]
        result = ngt.patch(model, client=self.client)
        self.assertEqual([name for name, _, _ in result.replaced], ["0"])
        self.assertEqual(result.left_alone, [
            ("1", "LayerNorm", "not an RMSNorm class"),
            ("2", "BiasedRMSNorm", "parameters ['bias', 'weight'] besides weight")])
        self.assertIs(model[1], layer_norm)
        self.assertIs(model[2], biased)
        # Patching again replaces nothing more.
        again = ngt.patch(model, client=self.client)
        self.assertEqual(again.replaced, [])
        self.assertEqual(len(again.left_alone), 2)

    def test_a_shared_layer_stays_shared(self):
        norm = LlamaRMSNorm(8)
        model = torch.nn.Sequential(norm, torch.nn.Linear(8, 8), norm)
        result = ngt.patch(model, client=self.client)
        self.assertEqual([name for name, _, _ in result.replaced], ["0", "2"])
        self.assertIs(model[0], model[2])
        self.assertIs(model[0].weight, norm.weight)


@unittest.skipIf(torch is None, "torch is not installed")
class PatchedTrainingTest(CpuServerFixture, unittest.TestCase):
    """Two-layer decoders (hidden 32, 2 heads, vocabulary 48), 5 steps of SGD with momentum on
    next-token prediction of learnable sequences (each a random start and stride, mod the
    vocabulary): local RMSNorm layers, and the same model patched (its copy from the same
    initial weights), on the same batches."""

    def train(self, model, batches):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        losses = []
        for tokens in batches:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    def check_family(self, model_class, offset, casting_mode):
        torch.manual_seed(7)
        local = model_class()
        patched = copy.deepcopy(local)
        result = ngt.patch(patched, client=self.client)
        self.assertEqual(len(result.replaced), 5)  # 2 per layer and the final norm
        self.assertEqual({(s["offset"], s["casting_mode"]) for _, _, s in result.replaced},
                         {(offset, casting_mode)})
        batches = [(torch.randint(0, 48, (8, 1)) + torch.randint(1, 4, (8, 1)) *
                    torch.arange(12)) % 48 for _ in range(5)]
        local_losses = self.train(local, batches)
        patched_losses = self.train(patched, batches)
        print(f"{model_class.__name__} losses, local:   {local_losses}\n"
              f"{model_class.__name__} losses, patched: {patched_losses}", file=sys.stderr)
        self.assertLess(local_losses[-1], local_losses[0])  # it learns
        worst = max(abs(p - l) / abs(l) for p, l in zip(patched_losses, local_losses))
        self.assertLessEqual(worst, LOSS_RTOL)
        # The norm weights moved, and moved alike (Gemma's from zeros).
        for name, weight in norm_weights(local).items():
            torch.testing.assert_close(norm_weights(patched)[name], weight, rtol=1e-4,
                                       atol=1e-5)

    def test_llama_style_decoder(self):
        self.check_family(LlamaForCausalLM, 0.0, "llama")

    def test_gemma_style_decoder(self):
        self.check_family(GemmaForCausalLM, 1.0, "gemma")


if __name__ == "__main__":
    unittest.main()
