"""meshnode's exception tree: every error meshnode raises on purpose derives from
:class:`MeshnodeError`, and is defined beside the code that raises it::

    MeshnodeError
    ├── ConfigError               bad configuration, flags or input (the CLI prints it, exit 2)
    │   ├── TokenError                a malformed join token (net.identity)
    │   ├── SecretFileError           a token or key file that is unsafe to use (net.secret_files)
    │   └── SpeculativeConfigError    a bad speculative setting (speculative.settings)
    ├── ModelError                a model cannot be opened, understood or loaded
    │   ├── ModelConfigError          config.json of an unsupported model (engine.config)
    │   ├── HybridConfigError         … of a hybrid model (engine.hybrid_config)
    │   ├── TemplateError             a chat template that fails to render (engine.tokenizer)
    │   ├── NoTokenizerError          text given to a model without a tokenizer (engine.tokenizer)
    │   ├── ModelLoadError            a reference or its files cannot be read (engine.loader)
    │   ├── DraftIncompatibleError    a draft model unfit for the target (speculative.draft)
    │   └── DraftUnavailableError     a draft model that cannot be used here (serve.speculation)
    ├── BackendError              the device or weights dtype cannot be had (engine.backend)
    ├── RollbackError             a sequence asked to roll back past its snapshots
    │                             (engine.recurrent)
    ├── PrefixMissError           a frame resumed from a cached prefix a stage does not hold
    │                             (engine.prefix_cache)
    ├── GrammarError              a grammar that does not compile, or tokens it forbids
    │                             (engine.constraint)
    ├── PeerIdentityError         a certificate not bound to its node id (net.identity)
    ├── MembershipError           an event the peer table cannot apply: a bug (node.membership)
    ├── PlanError                 the model cannot be placed on the live nodes
    ├── RunError                  a stage failed during Claim/Prepare/Load or while serving
    ├── PipelineError             a pass through the pipeline failed (node.pipeline)
    │   ├── StageLostError            a stage of the pipeline is gone: replay (node.pipeline)
    │   └── StageError                a frame one stage cannot process (node.stage)
    └── APIError                  answered as an OpenAI error body (serve.errors)
        ├── BadRequestError, ModelNotFoundError, ContextLengthError
        └── ServiceUnavailableError

Errors that were ``ValueError``/``RuntimeError`` before this tree keep that base too, so an
``except ValueError`` written earlier still catches them. Two exceptions stay outside the
tree because they never leave the module that raises them (control flow of the HTTP body
reader, caught a few lines up): ``net.http_guard._BodyRefused`` and ``_Disconnected``.
``tests/test_structure.py`` checks that this drawing names every exception class in the
package under its real parent.

Foreign exceptions are mapped once, at the boundary that meets them, with ``raise … from
exc``: ``meshnode_packaging``'s ``PackageError``/``SourceError`` (and the ``OSError``,
``ValueError`` and ``KeyError`` of reading a model) become :class:`ModelLoadError` in
:func:`meshnode.engine.loader.reading_model`; codec errors stay ``meshnode_protocol``'s
(``RemoteProtocolError``/``LocalProtocolError``) and close one connection.
"""


class MeshnodeError(Exception):
    """Base of every error meshnode raises on purpose."""


class ConfigError(MeshnodeError, ValueError):
    """An unknown key, a value of the wrong type, or an inconsistent combination."""


class ModelError(MeshnodeError, ValueError):
    """A model cannot be opened, understood or loaded; the message says why in one line."""


class PlanError(MeshnodeError):
    """No placement of the model's layers fits the live nodes."""


class RunError(MeshnodeError):
    """A run could not be brought up, or a stage failed while serving."""
