"""The JSON the API takes and gives (pydantic models: FastAPI checks requests against them and documents them
on its OpenAPI page, /docs)."""
from __future__ import annotations

from typing import Annotated, Optional

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


class ColourBar(BaseModel):
    colormap: str
    low: float
    high: float
    stops: list[str] = Field(description="colours from low to high (hex)")
    legend: str


class ImageMap(BaseModel):
    """One map of one image."""

    overlay: str = Field(description="the map over a grey copy of the model's input (PNG data URL)")
    map_png: str = Field(description="the map alone, coloured as in the overlay, at the input's size (PNG data URL)")
    scores: list[list[Optional[float]]] = Field(description="the raw scores (patch grid, or pixels for lrp)")
    npy: str = Field(description="the raw scores as a .npy file (float32), base64")
    shape: list[int]
    colour_bar: Optional[ColourBar] = Field(None, description="absent when the map is all zero")
    note: Optional[str] = None


class ClassScore(BaseModel):
    index: int
    name: str
    probability: float


class ImageResult(ImageMap):
    method: str
    signed: bool
    summary: str
    seconds: float


class ImageResponse(BaseModel):
    model: str
    input: str = Field(description="the image as the model saw it (after resizing and cropping; PNG data URL)")
    top: list[ClassScore] = Field(description="the classes with the highest probabilities (none for a model without classes)")
    target: str = Field(description="what was explained: a class name, or 'concept (N examples)'")
    target_index: Optional[int] = Field(None, description="the explained class (absent for a concept)")
    results: list[ImageResult]
    seconds: float


class TextResult(BaseModel):
    method: str
    signed: bool
    summary: str
    html: str = Field(description="the coloured words (the HTML export's rendering; scores in the tooltips)")
    tokens: list[str]
    scores: list[Optional[float]]
    words: list[tuple[str, Optional[float]]] = Field(description="word pieces merged, special tokens left out")
    seconds: float


class TextResponse(BaseModel):
    model: str
    top: list[ClassScore]
    target: str
    target_index: int
    warnings: list[str]
    results: list[TextResult]
    seconds: float


class PairMap(ImageMap):
    caption: str
    logit: float
    html: str = Field(description="the caption's coloured words (scores in the tooltips)")
    tokens: list[str]
    text_scores: list[Optional[float]]


class PairResult(BaseModel):
    method: str
    signed: bool
    summary: str
    legend: str = Field(description="how the caption's colours read")
    pairs: list[PairMap]
    seconds: float


class PairResponse(BaseModel):
    model: str
    input: str
    results: list[PairResult]
    seconds: float


class GenerationResponse(BaseModel):
    model: str
    method: str
    signed: bool
    text: str = Field(description="the generated text (or the continuation)")
    tokens: list[str] = Field(description="the prompt's and the generated tokens, each decoded alone")
    prompt_length: int
    generated_ids: list[int]
    rows: list[list[Optional[float]]] = Field(description="per generated token g, the relevance of the prompt_length + g "
                                                          "tokens before it for its logit (4 significant digits)")
    logits: list[Optional[float]] = Field(description="each generated token's explained logit")
    relevance_total: Optional[list[Optional[float]]] = Field(description="LRP methods: the share of each logit reaching the tokens")
    palette: list[list[str]] = Field(description="[background, text colour] from -1 to 1 (signed) or 0 to 1 of each row's maximum")
    seconds: float
