"""The JSON the API takes and gives (pydantic models: FastAPI checks requests against them and documents them
on its OpenAPI page, /docs)."""
from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, model_validator

#: the longest method, model or sample name a request may give (every real one is far shorter; names are echoed in errors)
NAME = Annotated[str, StringConstraints(max_length=64)]
METHODS_FIELD = Field(min_length=1, max_length=32, description="method names (GET /api/info lists them), run one after the other",
                      examples=[["generic_attention", "cdam"]])


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently ignored


class ImageInput(Strict):
    """One image: its file as base64 (PNG, JPEG, WebP or GIF, recognised from the content), or a sample's id."""

    data: Optional[str] = Field(None, description="the image file in base64; a `data:image/...;base64,` URL is accepted too")
    sample: Optional[NAME] = Field(None, description="the id of a sample picture (GET /api/info lists them)", examples=["scene-1"])

    @model_validator(mode="after")
    def one_source(self) -> "ImageInput":
        if (self.data is None) == (self.sample is None):
            raise ValueError("give the image as either 'data' (base64) or 'sample' (an id), exactly one")
        return self


class ImageRequest(Strict):
    """Explain one image with an image classifier."""

    image: ImageInput
    methods: list[NAME] = METHODS_FIELD
    model: Optional[NAME] = Field(None, description="one of the server's image models (default: the first)")
    target: Optional[StrictInt] = Field(None, description="class index to explain (default: the predicted class)")
    concept: Optional[list[ImageInput]] = Field(
        None, description="example images of a concept to explain instead of a class (CDAM; methods cdam and token_ablation)")


class TextRequest(Strict):
    """Explain one text with the server's text classifier."""

    text: str = Field(description="the text to explain", examples=["The side effects were awful but it worked"])
    methods: list[NAME] = METHODS_FIELD
    target: Optional[StrictInt] = Field(None, description="class index to explain (default: the predicted class)")


class PairRequest(Strict):
    """Explain an image against one or more captions with the server's image-text (CLIP) model."""

    image: ImageInput
    captions: list[str] = Field(min_length=1, max_length=64, description="one or more captions; each pairs with the image",
                                examples=[["a red star", "a blue ring"]])
    methods: list[NAME] = METHODS_FIELD


class GenerationRequest(Strict):
    """Generate greedily from a prompt with the server's decoder language model (or read a given continuation) and
    explain every generated token over the tokens before it."""

    prompt: str = Field(description="the prompt", examples=["The capital of France is"])
    max_new_tokens: StrictInt = Field(16, description="tokens to generate, 1 to the server's limit (GET /api/info); "
                                                      "generation stops earlier after an end-of-text token")
    method: NAME = Field("attnlrp", description="attnlrp, cp_lrp or input_x_gradient (one forward for every token)")
    continuation: Optional[str] = Field(None, description="explain this continuation of the prompt instead of generating")
    image: Optional[ImageInput] = Field(None, description="the image the prompt asks about: required where the server's model is "
                                                          "a vision-language decoder (GET /api/info: language_model.reads_images), "
                                                          "refused otherwise")


class ColourBar(BaseModel):
    colormap: str
    low: float
    high: float
    stops: list[str] = Field(description="colours from low to high (hex)")
    legend: str


class ImageView(BaseModel):
    """How the page draws one map of one image."""

    overlay: str = Field(description="the map over a grey copy of the model's input (PNG data URL)")
    map_png: str = Field(description="the map alone, coloured as in the overlay, at the input's size (PNG data URL)")
    colour_bar: Optional[ColourBar] = Field(None, description="absent when the map is all zero")
    note: Optional[str] = None


#: every result of the API: the explanation exactly as the library's `to_json()` gives it
EXPLANATION = Field(description="the result's to_json(): the schema relevancy.explanation/1 (docs/api.md): kind, method, "
                                "signed, target, logits, scores by part, tokens, ...; NaN written as null")


class Answer(BaseModel):
    summary: str = Field(description="what the method computes")
    seconds: float
    explanation: dict[str, Any] = EXPLANATION


class ImageResult(Answer):
    view: ImageView


class ImageResponse(BaseModel):
    model: str
    input: str = Field(description="the image as the model saw it (after resizing and cropping; PNG data URL)")
    results: list[ImageResult] = Field(description="one per method, in the order asked")
    seconds: float


class TextView(BaseModel):
    html: str = Field(description="the coloured words (the HTML export's rendering; scores in the tooltips)")


class TextResult(Answer):
    view: TextView


class TextResponse(BaseModel):
    model: str
    warnings: list[str]
    results: list[TextResult] = Field(description="one per method, in the order asked")
    seconds: float


class PairView(ImageView):
    html: str = Field(description="the caption's coloured words (scores in the tooltips)")


class PairsView(BaseModel):
    legend: str = Field(description="how the captions' colours read")
    pairs: list[PairView] = Field(description="one per caption, in the order given")


class PairResult(Answer):
    view: PairsView


class PairResponse(BaseModel):
    model: str
    input: str
    results: list[PairResult] = Field(description="one per method, in the order asked")
    seconds: float


class GenerationView(BaseModel):
    palette: list[list[str]] = Field(description="[background, text colour] from -1 to 1 (signed) or 0 to 1 of each row's maximum")


class GenerationResult(Answer):
    view: GenerationView


class GenerationResponse(BaseModel):
    model: str
    results: list[GenerationResult] = Field(description="the one method's: a GenerationExplanation (text, tokens, "
                                                        "prompt_length, generated_ids, a row per generated token); a "
                                                        "vision-language decoder's VisionLanguageGenerationExplanation "
                                                        "adds an image map per generated token (scores.image, image_url; "
                                                        "LLaVA-NeXT / OneVision: base_scores, the base tile's map)")
    seconds: float
