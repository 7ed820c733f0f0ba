"""The OpenAI front's routes, one APIRouter per endpoint family."""
